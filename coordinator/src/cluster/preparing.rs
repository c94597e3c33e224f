//! Workers that are downloading or loading their weights (issue 57): each
//! says so before it fetches anything (`WorkerHello::Prepare`) and then
//! streams its progress until it is ready, so `/v1/workers` lists it under
//! `preparing` with its layers, how it joined, and how far its download is.
//! A worker leaves the list when its report ends (it is loaded, or gone)
//! or when it registers, whichever comes first.

use std::collections::BTreeMap;
use std::time::Instant;

use common::protocol::{PrepareProgress, Preparing};
use common::transport;
use serde::Serialize;

use super::Cluster;

/// The workers preparing now, by connection.
#[derive(Default)]
pub(super) struct PreparingWorkers {
    workers: BTreeMap<u64, Entry>,
    next: u64,
}

struct Entry {
    name: String,
    address: String,
    layers: String,
    joined_by: &'static str,
    progress: PrepareProgress,
    since: Instant,
    updated: Instant,
}

/// A preparing worker as `/v1/workers` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct PreparingInfo {
    pub name: String,
    pub address: String,
    /// The layers it will hold, inclusive ("0-11").
    pub layers: String,
    pub joined_by: &'static str,
    /// "downloading" or "loading".
    pub phase: &'static str,
    pub files_done: u32,
    pub files_total: u32,
    /// Bytes downloaded so far, over every file.
    pub downloaded_bytes: u64,
    /// The file being downloaded, with its bytes done and size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<FileProgress>,
    pub seconds_preparing: f64,
    pub seconds_since_update: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct FileProgress {
    pub name: String,
    pub bytes_done: u64,
    pub bytes_total: u64,
}

impl PreparingWorkers {
    fn infos(&self, now: Instant) -> Vec<PreparingInfo> {
        self.workers
            .values()
            .map(|e| {
                let download = &e.progress.download;
                PreparingInfo {
                    name: e.name.clone(),
                    address: e.address.clone(),
                    layers: e.layers.clone(),
                    joined_by: e.joined_by,
                    phase: e.progress.phase.as_str(),
                    files_done: download.files_done,
                    files_total: download.files_total,
                    downloaded_bytes: download.bytes_done,
                    file: (!download.file.is_empty()).then(|| FileProgress {
                        name: download.file.clone(),
                        bytes_done: download.file_bytes_done,
                        bytes_total: download.file_bytes_total,
                    }),
                    seconds_preparing: now.saturating_duration_since(e.since).as_secs_f64(),
                    seconds_since_update: now.saturating_duration_since(e.updated).as_secs_f64(),
                }
            })
            .collect()
    }

    /// Forgets the entries of worker `name` (it registered).
    pub(super) fn registered(&mut self, name: &str) {
        self.workers.retain(|_, e| e.name != name);
    }
}

impl Cluster {
    pub(super) fn preparing_workers(&self) -> std::sync::MutexGuard<'_, PreparingWorkers> {
        self.preparing.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The workers downloading or loading their weights.
    pub fn preparing(&self) -> Vec<PreparingInfo> {
        self.preparing_workers().infos(Instant::now())
    }

    /// Lists an authenticated preparing worker and follows its progress
    /// until its report ends.
    pub(super) async fn serve_prepare(
        &self,
        conn: quinn::Connection,
        preparing: Preparing,
        mut send: quinn::SendStream,
        mut recv: quinn::RecvStream,
    ) -> Result<(), String> {
        self.accept_proving_the_secret(&conn, &mut send).await?;
        let _ = send.finish();
        let address = conn.remote_address().to_string();
        tracing::info!(
            "worker {:?} at {address} is fetching and loading layers {} (joined by {})",
            preparing.worker_name,
            preparing.layers,
            preparing.joined_by.as_str()
        );
        let now = Instant::now();
        let id = {
            let mut workers = self.preparing_workers();
            let id = workers.next;
            workers.next += 1;
            let entry = Entry {
                name: preparing.worker_name.clone(),
                address,
                layers: preparing.layers.clone(),
                joined_by: preparing.joined_by.as_str(),
                progress: PrepareProgress::default(),
                since: now,
                updated: now,
            };
            workers.workers.insert(id, entry);
            id
        };
        let ended = loop {
            match transport::read_frame::<PrepareProgress>(&mut recv).await {
                Ok(Some(progress)) => {
                    if let Some(entry) = self.preparing_workers().workers.get_mut(&id) {
                        entry.progress = progress;
                        entry.updated = Instant::now();
                    }
                }
                Ok(None) => break Ok(()),
                Err(e) => break Err(format!("worker {:?} stopped preparing: {e}", preparing.worker_name)),
            }
        };
        let entry = self.preparing_workers().workers.remove(&id);
        if let (Ok(()), Some(entry)) = (&ended, entry) {
            tracing::info!(
                "worker {:?} has its weights ({} files, {:.1} MB downloaded, {:.1} s)",
                entry.name,
                entry.progress.download.files_total,
                entry.progress.download.bytes_done as f64 / 1e6,
                entry.since.elapsed().as_secs_f64()
            );
        }
        conn.close(0u32.into(), b"prepared");
        ended
    }
}
