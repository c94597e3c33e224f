//! The SSD tier's files: one file a block, named by its hash, in a
//! directory of its own per model identity, written and read by one I/O
//! thread so no step waits on the disk.
//!
//! A file is a header (magic, hash, parent, tokens, payload length), the
//! payload (the block's KV as the pool stores it) and an xxh3 checksum of
//! both. It is written to a temporary name and renamed, so a crash leaves
//! either the whole file or a `.tmp` that the next start deletes; a file
//! whose checksum, length or name disagrees is deleted, never used.

use std::collections::HashMap;
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender};
use std::thread::JoinHandle;

use common::BlockHash;
use xxhash_rust::xxh3::Xxh3;

use crate::error::{Result, WorkerError};

const MAGIC: &[u8; 8] = b"TVKVBLK1";
const EXTENSION: &str = "kvb";

/// What must match for a block written by one worker to be read by
/// another (or by itself after a restart): the model's config and weights,
/// the layers held, the cache's format and block size, and the block
/// hash's seed. Its fingerprint names the directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub description: String,
    pub fingerprint: u64,
}

impl Identity {
    /// `parts` describe the cache (format, block size, layers, bytes per
    /// block); `weights` are fingerprinted by size and their first and
    /// last MiB (a full hash of gigabytes would delay every start).
    pub fn new(config_hash: u64, weights: &[PathBuf], parts: &str) -> Result<Self> {
        let mut hasher = Xxh3::new();
        hasher.update(&config_hash.to_le_bytes());
        hasher.update(&common::block_hash::BLOCK_HASH_SEED.to_le_bytes());
        hasher.update(parts.as_bytes());
        for path in weights {
            fingerprint_file(&mut hasher, path).map_err(|error| WorkerError::TierDir { path: path.clone(), error })?;
        }
        let fingerprint = hasher.digest();
        let seed = common::block_hash::BLOCK_HASH_SEED;
        Ok(Self { description: format!("config {config_hash:016x}, {parts}, seed {seed:016x}"), fingerprint })
    }
}

/// A weights file's size, first MiB and last MiB.
fn fingerprint_file(hasher: &mut Xxh3, path: &Path) -> std::io::Result<()> {
    {
        {
            let mut file = fs::File::open(path)?;
            let len = file.metadata()?.len();
            hasher.update(&len.to_le_bytes());
            let mut head = vec![0u8; len.min(1 << 20) as usize];
            file.read_exact(&mut head)?;
            hasher.update(&head);
            if len > 2 << 20 {
                use std::io::Seek;
                file.seek(std::io::SeekFrom::End(-(1 << 20)))?;
                file.read_exact(&mut head)?;
                hasher.update(&head);
            }
        }
    }
    Ok(())
}

/// A block's entry as a restarted worker finds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundBlock {
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    pub tokens: Vec<u32>,
}

pub enum Job {
    Write { hash: BlockHash, parent: Option<BlockHash>, tokens: Vec<u32>, bytes: Arc<[u8]> },
    Delete(BlockHash),
    Load(BlockHash),
}

pub enum Done {
    Written(BlockHash),
    WriteFailed(BlockHash, String),
    /// The payload, or why it could not be used (the file is gone then).
    Loaded(BlockHash, std::result::Result<Vec<u8>, String>),
}

/// The directory and its I/O thread.
pub struct Disk {
    pub dir: PathBuf,
    jobs: Option<Sender<Job>>,
    pub done: Receiver<Done>,
    thread: Option<JoinHandle<()>>,
    /// Held while open: no other worker writes this directory.
    _lock: fs::File,
}

impl Disk {
    /// Opens (creating) `root`'s directory for `identity` and lists the
    /// blocks it holds, oldest first; leftover temporary files and files
    /// that do not parse are deleted.
    /// Two workers on one machine may share a root: each locks its
    /// directory, and the second of one identity takes the next one.
    pub fn open(root: &Path, identity: &Identity) -> Result<(Self, Vec<FoundBlock>)> {
        for copy in 0..64 {
            let name = match copy {
                0 => format!("{:016x}", identity.fingerprint),
                n => format!("{:016x}.{n}", identity.fingerprint),
            };
            let dir = root.join(name);
            let locked = (|| {
                fs::create_dir_all(&dir)?;
                let lock = fs::OpenOptions::new().create(true).truncate(false).write(true).open(dir.join("lock"))?;
                match lock.try_lock() {
                    Ok(()) => Ok(Some(lock)),
                    Err(fs::TryLockError::WouldBlock) => Ok(None),
                    Err(fs::TryLockError::Error(e)) => Err(e),
                }
            })()
            .map_err(|error| WorkerError::TierDir { path: dir.clone(), error })?;
            if let Some(lock) = locked {
                return Self::open_dir(dir.clone(), identity, lock)
                    .map_err(|error| WorkerError::TierDir { path: dir, error });
            }
        }
        Err(WorkerError::KvCache(format!("every KV tier directory under {} is in use", root.display())))
    }

    fn open_dir(dir: PathBuf, identity: &Identity, lock: fs::File) -> std::io::Result<(Self, Vec<FoundBlock>)> {
        let about = dir.join("identity.txt");
        if !about.exists() {
            fs::write(&about, format!("{}\n", identity.description))?;
        }
        let mut found = Vec::new();
        for entry in fs::read_dir(&dir)? {
            let path = entry?.path();
            match path.extension().and_then(|e| e.to_str()) {
                Some(EXTENSION) => match read_header(&path) {
                    Ok((block, _)) if path.file_stem() == Some(file_stem(block.hash).as_ref()) => {
                        let modified = fs::metadata(&path).and_then(|m| m.modified()).ok();
                        found.push((modified, block));
                    }
                    Ok(_) | Err(_) => {
                        tracing::warn!(file = %path.display(), "KV tier: an unreadable block file, deleted");
                        let _ = fs::remove_file(&path);
                    }
                },
                Some("tmp") => {
                    let _ = fs::remove_file(&path);
                }
                _ => {}
            }
        }
        found.sort_by_key(|(modified, _)| *modified);
        let (jobs, jobs_rx) = std::sync::mpsc::channel();
        let (done_tx, done) = std::sync::mpsc::channel();
        let thread_dir = dir.clone();
        let thread = std::thread::Builder::new()
            .name("kv-tier-disk".into())
            .spawn(move || run(&thread_dir, jobs_rx, done_tx))?;
        let disk = Self { dir, jobs: Some(jobs), done, thread: Some(thread), _lock: lock };
        Ok((disk, found.into_iter().map(|(_, block)| block).collect()))
    }

    pub fn send(&self, job: Job) {
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(job);
        }
    }

    #[cfg(test)]
    pub fn path_of(&self, hash: BlockHash) -> PathBuf {
        block_path(&self.dir, hash)
    }
}

impl Drop for Disk {
    /// Finishes the queued writes (a clean stop keeps every block).
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn file_stem(hash: BlockHash) -> String {
    format!("{:016x}", hash.0)
}

fn block_path(dir: &Path, hash: BlockHash) -> PathBuf {
    dir.join(format!("{}.{EXTENSION}", file_stem(hash)))
}

fn run(dir: &Path, jobs: Receiver<Job>, done: Sender<Done>) {
    let path_of = |hash: BlockHash| block_path(dir, hash);
    let mut written: HashMap<BlockHash, usize> = HashMap::new();
    for job in jobs {
        let reply = match job {
            Job::Write { hash, parent, tokens, bytes } => {
                let header = FoundBlock { hash, parent, tokens };
                match write_block(&path_of(hash), &header, &bytes) {
                    Ok(()) => {
                        written.insert(hash, bytes.len());
                        Done::Written(hash)
                    }
                    Err(e) => Done::WriteFailed(hash, e.to_string()),
                }
            }
            Job::Delete(hash) => {
                written.remove(&hash);
                let _ = fs::remove_file(path_of(hash));
                continue;
            }
            Job::Load(hash) => {
                let path = path_of(hash);
                let loaded = read_block(&path, hash).map_err(|e| e.to_string());
                if loaded.is_err() {
                    let _ = fs::remove_file(&path);
                }
                Done::Loaded(hash, loaded)
            }
        };
        if done.send(reply).is_err() {
            return;
        }
    }
}

fn header_bytes(block: &FoundBlock, payload_len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(48 + 4 * block.tokens.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&block.hash.0.to_le_bytes());
    out.push(u8::from(block.parent.is_some()));
    out.extend_from_slice(&block.parent.map_or(0, |p| p.0).to_le_bytes());
    out.extend_from_slice(&(block.tokens.len() as u32).to_le_bytes());
    for t in &block.tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out.extend_from_slice(&(payload_len as u64).to_le_bytes());
    out
}

fn checksum(header: &[u8], payload: &[u8]) -> u64 {
    let mut hasher = Xxh3::new();
    hasher.update(header);
    hasher.update(payload);
    hasher.digest()
}

/// Writes the block to a temporary file, syncs nothing (a lost write is a
/// miss, not an error) and renames it into place.
fn write_block(path: &Path, block: &FoundBlock, payload: &[u8]) -> std::io::Result<()> {
    let header = header_bytes(block, payload.len());
    let tmp = path.with_extension("tmp");
    let result = (|| {
        let mut file = std::io::BufWriter::new(fs::File::create(&tmp)?);
        file.write_all(&header)?;
        file.write_all(payload)?;
        file.write_all(&checksum(&header, payload).to_le_bytes())?;
        file.into_inner().map_err(|e| e.into_error())?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

fn invalid(message: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, message.to_string())
}

/// The header of a block file and its payload's length.
fn read_header(path: &Path) -> std::io::Result<(FoundBlock, u64)> {
    let mut file = std::io::BufReader::new(fs::File::open(path)?);
    let (block, payload_len, _) = parse_header(&mut file)?;
    let len = fs::metadata(path)?.len();
    let header_len = header_bytes(&block, payload_len as usize).len() as u64;
    if len != header_len + payload_len + 8 {
        return Err(invalid("a truncated block file"));
    }
    Ok((block, payload_len))
}

fn parse_header(file: &mut impl Read) -> std::io::Result<(FoundBlock, u64, Vec<u8>)> {
    let mut fixed = [0u8; 8 + 8 + 1 + 8 + 4];
    file.read_exact(&mut fixed)?;
    if &fixed[..8] != MAGIC {
        return Err(invalid("not a KV block file"));
    }
    let u64_at = |at: usize| u64::from_le_bytes(fixed[at..at + 8].try_into().expect("8 bytes"));
    let hash = BlockHash(u64_at(8));
    let parent = (fixed[16] == 1).then(|| BlockHash(u64_at(17)));
    let n = u32::from_le_bytes(fixed[25..29].try_into().expect("4 bytes")) as usize;
    if n > 1 << 16 {
        return Err(invalid("a block of too many tokens"));
    }
    let mut raw = vec![0u8; 4 * n + 8];
    file.read_exact(&mut raw)?;
    let tokens = raw[..4 * n].chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
    let payload_len = u64::from_le_bytes(raw[4 * n..].try_into().expect("8 bytes"));
    let block = FoundBlock { hash, parent, tokens };
    let header = header_bytes(&block, payload_len as usize);
    Ok((block, payload_len, header))
}

/// The payload of `hash`'s file, its checksum and length checked.
pub fn read_block(path: &Path, hash: BlockHash) -> std::io::Result<Vec<u8>> {
    let mut file = std::io::BufReader::new(fs::File::open(path)?);
    let (block, payload_len, header) = parse_header(&mut file)?;
    if block.hash != hash {
        return Err(invalid("a block file under another block's name"));
    }
    if payload_len > 1 << 34 {
        return Err(invalid("an implausible payload length"));
    }
    let mut payload = vec![0u8; payload_len as usize];
    file.read_exact(&mut payload)?;
    let mut sum = [0u8; 8];
    file.read_exact(&mut sum)?;
    if u64::from_le_bytes(sum) != checksum(&header, &payload) {
        return Err(invalid("a block whose checksum does not match"));
    }
    if file.read(&mut [0u8; 1])? != 0 {
        return Err(invalid("bytes past a block's checksum"));
    }
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tinyvllm-tier-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    fn identity() -> Identity {
        Identity { description: "test".into(), fingerprint: 0xabc }
    }

    #[test]
    fn a_block_written_is_found_and_read_back_and_damage_is_refused() {
        let root = temp_dir("roundtrip");
        let block = FoundBlock { hash: BlockHash(42), parent: Some(BlockHash(7)), tokens: vec![1, 2, 3] };
        let payload: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        {
            let (disk, found) = Disk::open(&root, &identity()).unwrap();
            assert!(found.is_empty());
            disk.send(Job::Write {
                hash: block.hash,
                parent: block.parent,
                tokens: block.tokens.clone(),
                bytes: payload.clone().into(),
            });
            assert!(matches!(disk.done.recv().unwrap(), Done::Written(BlockHash(42))));
        }
        let (disk, found) = Disk::open(&root, &identity()).unwrap();
        assert_eq!(found, vec![block.clone()]);
        let path = disk.path_of(block.hash);
        assert_eq!(read_block(&path, block.hash).unwrap(), payload);
        assert!(read_block(&path, BlockHash(43)).is_err(), "another block's name");
        // One flipped payload byte: the checksum refuses it, and a load deletes it.
        let mut bytes = fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 1;
        fs::write(&path, &bytes).unwrap();
        disk.send(Job::Load(block.hash));
        assert!(matches!(disk.done.recv().unwrap(), Done::Loaded(_, Err(_))));
        assert!(!path.exists());
        drop(disk);
        // A truncated file is dropped when found.
        fs::write(root.join("000000000000002a.kvb"), &bytes[..bytes.len() - 9]).unwrap();
        let (_disk, found) = Disk::open(&root, &identity()).unwrap();
        assert!(found.is_empty());
        // Another identity reads another directory.
        let (_, found) = Disk::open(&root, &Identity { fingerprint: 0xdef, ..identity() }).unwrap();
        assert!(found.is_empty());
        // A second worker of the same identity beside the first takes a directory of its own.
        let (first, _) = Disk::open(&root, &identity()).unwrap();
        let (second, _) = Disk::open(&root, &identity()).unwrap();
        assert_ne!(first.dir, second.dir);
        let _ = fs::remove_dir_all(&root);
    }
}
