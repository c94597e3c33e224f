//! The page the coordinator serves at `/`: a playground that streams from
//! the API and a live view of the cluster (workers, pipeline stages, KV
//! cache, load, prefix hits, tokens/s, failovers). The files are in this
//! directory and embedded in the binary: no CDN, so it works offline. The
//! files themselves are public (they hold nothing); the API calls they make
//! carry the key the user enters, as any client's do.

use hyper::StatusCode;

use crate::api::reply::Reply;

const INDEX: &str = include_str!("index.html");
const SCRIPT: &str = include_str!("app.js");
const STYLE: &str = include_str!("style.css");

/// The page's file at `path`, if it is one.
pub fn file(path: &str) -> Option<Reply> {
    let (content_type, body) = match path {
        "/" | "/index.html" => ("text/html; charset=utf-8", INDEX),
        "/ui/app.js" => ("text/javascript; charset=utf-8", SCRIPT),
        "/ui/style.css" => ("text/css; charset=utf-8", STYLE),
        _ => return None,
    };
    Some(Reply::text(StatusCode::OK, content_type, body.to_string()))
}
