//! A model hub on loopback for the download tests: it answers the Hugging
//! Face hub's file protocol (`GET {repo}/resolve/{revision}/{file}`, the
//! `Range: bytes=0-0` probe with its `ETag`, `X-Repo-Commit` and
//! `Content-Range` headers, then ranged downloads) as the real hub does for
//! the real `hf-hub` client the binaries use, serves one directory at a
//! set speed, and records what was fetched. Also a re-sharder that writes a
//! test model's weights as the hub's sharded checkpoints are laid out.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The commit every file is served at.
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// One repo's files from a directory, on `endpoint`.
pub struct FakeHub {
    /// What `HF_ENDPOINT` is set to: `http://127.0.0.1:PORT`.
    pub endpoint: String,
    fetched: Arc<Mutex<Vec<String>>>,
}

impl FakeHub {
    /// Serves the files of `dir` as repo `repo` (`org/name`), bodies at
    /// about `bytes_per_second`.
    pub fn serve(repo: &str, dir: &Path, bytes_per_second: u64) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("binding the hub");
        let endpoint = format!("http://{}", listener.local_addr().expect("an address"));
        let fetched = Arc::new(Mutex::new(Vec::new()));
        let site = Site { prefix: format!("/{repo}/resolve/main/"), dir: dir.to_path_buf(), bytes_per_second };
        let site = Arc::new(site);
        let log = fetched.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (site, log) = (site.clone(), log.clone());
                std::thread::spawn(move || {
                    let _ = site.answer(stream, &log);
                });
            }
        });
        Self { endpoint, fetched }
    }

    /// The files whose bodies were downloaded (not only probed), in order.
    pub fn downloaded(&self) -> Vec<String> {
        self.fetched.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

struct Site {
    prefix: String,
    dir: PathBuf,
    bytes_per_second: u64,
}

impl Site {
    fn answer(&self, mut stream: TcpStream, fetched: &Mutex<Vec<String>>) -> std::io::Result<()> {
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut request = String::new();
        reader.read_line(&mut request)?;
        let mut range = None;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line)? == 0 || line.trim().is_empty() {
                break;
            }
            if let Some((name, value)) = line.split_once(':')
                && name.trim().eq_ignore_ascii_case("range")
            {
                range = value.trim().strip_prefix("bytes=").map(str::to_string);
            }
        }
        let path = request.split_whitespace().nth(1).unwrap_or_default();
        let body = path
            .strip_prefix(&self.prefix)
            .filter(|file| !file.contains('/') && !file.contains(".."))
            .and_then(|file| Some((file.to_string(), std::fs::read(self.dir.join(file)).ok()?)));
        let Some((file, body)) = body else {
            let message = "Entry not found";
            write!(
                stream,
                "HTTP/1.1 404 Not Found\r\nX-Error-Code: EntryNotFound\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{message}",
                message.len()
            )?;
            return Ok(());
        };
        let size = body.len() as u64;
        let (start, end) = match range.as_deref().and_then(|r| r.split_once('-')) {
            Some((a, b)) => {
                let start: u64 = a.parse().unwrap_or(0);
                let end: u64 = b.parse().map(|e: u64| e.min(size.saturating_sub(1))).unwrap_or(size.saturating_sub(1));
                (start.min(size), end)
            }
            None => (0, size.saturating_sub(1)),
        };
        let probe = range.as_deref() == Some("0-0");
        if !probe {
            fetched.lock().unwrap_or_else(|p| p.into_inner()).push(file.clone());
        }
        let part = &body[start as usize..(end + 1).max(start) as usize];
        write!(
            stream,
            "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {start}-{end}/{size}\r\nContent-Length: {}\r\n\
             ETag: \"{}\"\r\nX-Repo-Commit: {COMMIT}\r\nConnection: close\r\n\r\n",
            part.len(),
            etag(&body)
        )?;
        const CHUNK: usize = 8 << 10;
        for chunk in part.chunks(CHUNK) {
            stream.write_all(chunk)?;
            if !probe {
                std::thread::sleep(Duration::from_secs_f64(chunk.len() as f64 / self.bytes_per_second as f64));
            }
        }
        stream.flush()
    }
}

/// A content hash as the hub's ETag (FNV-1a, hex).
fn etag(bytes: &[u8]) -> String {
    let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    format!("{hash:016x}{:08x}", bytes.len())
}

/// Copies test model `source` to `dest` with its `model.safetensors` split
/// as the hub's big checkpoints are: a shard per decoder layer, one for the
/// other tensors before the layers (the embeddings), one for those after
/// (the final norm, lm_head), and `model.safetensors.index.json`. Returns
/// the shard names in order.
pub fn shard_by_layer(source: &Path, dest: &Path) -> Vec<String> {
    std::fs::create_dir_all(dest).expect("the sharded model's directory");
    for entry in std::fs::read_dir(source).expect("the model's directory") {
        let path = entry.expect("an entry").path();
        let name = path.file_name().expect("a file name").to_string_lossy().into_owned();
        if name != "model.safetensors" && path.is_file() {
            std::fs::copy(&path, dest.join(&name)).expect("copying a model file");
        }
    }
    let bytes = std::fs::read(source.join("model.safetensors")).expect("model.safetensors");
    let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + header_len]).expect("a safetensors header");
    let data = &bytes[8 + header_len..];
    // Group key: 0 before the layers, 1 + n for layer n, and after them.
    let mut groups: BTreeMap<usize, Vec<(&String, &serde_json::Value)>> = BTreeMap::new();
    let layers = header.keys().filter_map(|k| layer_of(k)).max().map_or(0, |l| l + 1);
    for (name, info) in header.iter().filter(|(k, _)| *k != "__metadata__") {
        let group = match layer_of(name) {
            Some(layer) => 1 + layer,
            None if name.contains("embed") => 0,
            None => 1 + layers,
        };
        groups.entry(group).or_default().push((name, info));
    }
    let count = groups.len();
    let mut weight_map = serde_json::Map::new();
    let mut shards = Vec::new();
    for (k, tensors) in groups.values().enumerate() {
        let shard = format!("model-{:05}-of-{count:05}.safetensors", k + 1);
        let mut shard_header = serde_json::Map::new();
        let mut shard_data = Vec::new();
        for (name, info) in tensors {
            let offsets = info["data_offsets"].as_array().expect("data_offsets");
            let (start, end) = (offsets[0].as_u64().unwrap() as usize, offsets[1].as_u64().unwrap() as usize);
            let begin = shard_data.len();
            shard_data.extend_from_slice(&data[start..end]);
            let mut info = (*info).clone();
            info["data_offsets"] = serde_json::json!([begin, shard_data.len()]);
            shard_header.insert((*name).clone(), info);
            weight_map.insert((*name).clone(), serde_json::Value::String(shard.clone()));
        }
        let mut header_bytes = serde_json::to_vec(&shard_header).expect("a header");
        while !header_bytes.len().is_multiple_of(8) {
            header_bytes.push(b' ');
        }
        let mut file = (header_bytes.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(&header_bytes);
        file.extend_from_slice(&shard_data);
        std::fs::write(dest.join(&shard), file).expect("writing a shard");
        shards.push(shard);
    }
    let index = serde_json::json!({"metadata": {"total_size": data.len()}, "weight_map": weight_map});
    std::fs::write(dest.join("model.safetensors.index.json"), index.to_string()).expect("writing the index");
    shards
}

fn layer_of(tensor: &str) -> Option<usize> {
    tensor.strip_prefix("model.layers.")?.split('.').next()?.parse().ok()
}
