//! hyper answers what it cannot parse by itself, before any handler runs: a
//! bad request line or header (400), a head over its buffer or with too
//! many headers (431), a URI over its limit (414). Its answer is a bare
//! head, `content-length: 0`, and the connection closes. A client then
//! sees no error message, where every other refusal has the OpenAI-shaped
//! JSON body (issue 58, point 7).
//!
//! [`JsonRefusals`] wraps the connection's socket and, on the way out,
//! replaces such a head with the same status carrying our JSON error. It
//! recognises hyper's automatic answer exactly: a status line of 400, 414
//! or 431 (at the start of a write, or after the end of the response
//! before it, which hyper may not have flushed yet), whose whole head,
//! CRLF-terminated lines, has `content-length: 0` and no `content-type`.
//! Every answer of ours has a content type, and none of our bodies holds a
//! CRLF (JSON, SSE and metrics lines end in LF), so no body is mistaken
//! for such a head. Writes are never vectored, so hyper hands over each
//! head whole.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use hyper::StatusCode;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::api::ApiError;

/// A socket whose outgoing bytes have hyper's bodiless refusals replaced.
pub struct JsonRefusals<S> {
    inner: S,
    /// A rewritten refusal not yet fully written, and how much of it was.
    pending: Vec<u8>,
    written: usize,
}

impl<S> JsonRefusals<S> {
    pub fn new(inner: S) -> Self {
        Self { inner, pending: Vec::new(), written: 0 }
    }
}

impl<S: AsyncWrite + Unpin> JsonRefusals<S> {
    /// Writes what is pending; ready once nothing is.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while self.written < self.pending.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.pending[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.pending.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for JsonRefusals<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for JsonRefusals<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let this = &mut *self;
        ready!(this.poll_pending(cx))?;
        match find_refusal(buf) {
            None => Pin::new(&mut this.inner).poll_write(cx, buf),
            // The responses before it go first, as they are.
            Some(Refusal { at, .. }) if at > 0 => Pin::new(&mut this.inner).poll_write(cx, &buf[..at]),
            Some(Refusal { head_len, status, .. }) => {
                this.pending = json_refusal(status);
                // Taken whole; what the socket does not take now goes at the next write or flush.
                if let Poll::Ready(Err(e)) = this.poll_pending(cx) {
                    return Poll::Ready(Err(e));
                }
                Poll::Ready(Ok(head_len))
            }
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        false
    }
}

/// Where hyper's automatic refusal head is in `buf`.
#[derive(Debug, PartialEq)]
struct Refusal {
    at: usize,
    head_len: usize,
    status: StatusCode,
}

fn find_refusal(buf: &[u8]) -> Option<Refusal> {
    const START: &[u8] = b"HTTP/1.1 ";
    let mut from = 0;
    while let Some(offset) = find(&buf[from..], START) {
        let at = from + offset;
        from = at + 1;
        let status = match buf.get(at + START.len()..at + START.len() + 4) {
            Some(b"400 ") => StatusCode::BAD_REQUEST,
            Some(b"414 ") => StatusCode::URI_TOO_LONG,
            Some(b"431 ") => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            _ => continue,
        };
        let Some(end) = find(&buf[at..], b"\r\n\r\n") else { continue };
        let head = String::from_utf8_lossy(&buf[at..at + end]).to_ascii_lowercase();
        if head.contains("\r\ncontent-length: 0") && !head.contains("\r\ncontent-type:") {
            return Some(Refusal { at, head_len: end + 4, status });
        }
    }
    None
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Our answer for hyper's refusal `status`: the same status, the reason in
/// OpenAI's error shape, and the connection closed (as hyper closes it).
fn json_refusal(status: StatusCode) -> Vec<u8> {
    let error = match status {
        StatusCode::URI_TOO_LONG => ApiError::uri_too_long(super::MAX_URI_BYTES),
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => ApiError::headers_too_large(format!(
            "The request's headers are too large: at most {} headers and {} KiB.",
            super::MAX_HEADERS,
            super::MAX_HEADER_BYTES >> 10
        )),
        _ => ApiError::bad_request(
            "The request is not valid HTTP/1.1: its request line or a header could not be parsed.",
        ),
    };
    let body = error.body();
    format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYPER_431: &[u8] =
        b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\n\
                               date: Sun, 29 Nov 2026 23:17:56 GMT\r\n\r\n";

    #[test]
    fn hypers_own_refusals_are_found_where_a_response_starts() {
        let found = find_refusal(HYPER_431).expect("found");
        assert_eq!(
            found,
            Refusal { at: 0, head_len: HYPER_431.len(), status: StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE }
        );
        // After a whole response in the same write.
        let before = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
        let both = [&before[..], HYPER_431].concat();
        assert_eq!(find_refusal(&both).map(|r| r.at), Some(before.len()));
        let chunked_end =
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n";
        let both = [&chunked_end[..], HYPER_431].concat();
        assert_eq!(find_refusal(&both).map(|r| r.at), Some(chunked_end.len()));
        // Ours: a content type, a body.
        let ours = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 9\r\n\r\n";
        assert_eq!(find_refusal(ours), None);
        // Other statuses, or text that only looks like a head, are left alone.
        assert_eq!(find_refusal(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"), None);
        assert_eq!(find_refusal(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n"), None, "not a whole head");
    }

    #[test]
    fn the_answer_is_a_whole_json_response() {
        let text = String::from_utf8(json_refusal(StatusCode::BAD_REQUEST)).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{head}");
        assert!(head.contains(&format!("content-length: {}", body.len())) && head.contains("connection: close"));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(v["error"]["message"].as_str().unwrap().contains("HTTP/1.1"));
    }

    /// Through the wrapper: a 200 passes as it is, the refusal after it is replaced.
    #[tokio::test]
    async fn the_wrapper_rewrites_only_the_refusal() {
        use tokio::io::AsyncWriteExt;
        let (client, server) = tokio::io::duplex(1 << 16);
        let mut wrapped = JsonRefusals::new(server);
        let ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}".to_vec();
        wrapped.write_all(&ok).await.unwrap();
        wrapped.write_all(HYPER_431).await.unwrap();
        wrapped.shutdown().await.unwrap();
        drop(wrapped);
        let mut got = Vec::new();
        let mut client = client;
        tokio::io::AsyncReadExt::read_to_end(&mut client, &mut got).await.unwrap();
        let text = String::from_utf8(got).unwrap();
        assert!(text.starts_with(std::str::from_utf8(&ok).unwrap()), "{text}");
        let rest = &text[ok.len()..];
        assert!(
            rest.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json"),
            "{rest}"
        );
        assert!(rest.contains("\"error\""), "{rest}");
    }
}
