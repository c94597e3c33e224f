//! A worker's report to the coordinator while it downloads and loads its
//! weights (issue 57): before fetching anything it says who it is and
//! which layers it will hold (`WorkerHello::Prepare`), then streams its
//! [`PrepareProgress`] a few times a second until it is ready, so
//! `/v1/workers` shows a stage's download as it goes. The report is a
//! courtesy, except that a coordinator refusing this worker (wrong cluster
//! secret, another model) stops it before it downloads gigabytes: an
//! unreachable coordinator only means no progress is shown, and the worker
//! registers (with its own retries) once loaded.

use std::net::SocketAddr;
use std::time::Duration;

use common::protocol::{DownloadProgress, OfferReply, PreparePhase, PrepareProgress, Preparing, WorkerHello};
use common::transport::{self, Role};
use tokio::sync::watch;

/// How long the report may take to be accepted before the worker goes on
/// without one.
const ACCEPT_TIMEOUT: Duration = Duration::from_secs(3);

/// How often progress is sent at most.
const SEND_EVERY: Duration = Duration::from_millis(250);

#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error("the coordinator refused this worker: {0}")]
    Refused(String),
    #[error("the coordinator could not prove the cluster secret")]
    CoordinatorNotAuthenticated,
}

/// The progress being reported; dropping it ends the report (the
/// coordinator then forgets this worker until it registers).
pub struct Reporter {
    progress: watch::Sender<PrepareProgress>,
}

impl Reporter {
    /// Connects to `coordinator` (HOST:PORT) and has `preparing` accepted;
    /// `Ok(None)` when the coordinator cannot be reached in time (logged).
    /// `preparing`'s auth tag is filled in here, for the session.
    pub fn start(coordinator: &str, secret: &str, preparing: Preparing) -> Result<Option<Self>, PrepareError> {
        let (progress, updates) = watch::channel(PrepareProgress::default());
        let (accepted_tx, accepted) = std::sync::mpsc::channel();
        let (coordinator, secret) = (coordinator.to_string(), secret.to_string());
        let spawned = std::thread::Builder::new().name("prepare-report".into()).spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(runtime) => runtime,
                Err(e) => {
                    let _ = accepted_tx.send(Err(e.to_string()));
                    return;
                }
            };
            runtime.block_on(report(&coordinator, &secret, preparing, updates, accepted_tx));
        });
        if let Err(e) = spawned {
            tracing::warn!("cannot report this worker's progress to the coordinator: {e}");
            return Ok(None);
        }
        match accepted.recv_timeout(ACCEPT_TIMEOUT) {
            Ok(Ok(Accepted::Yes)) => Ok(Some(Self { progress })),
            Ok(Ok(Accepted::Refused(reason))) => Err(PrepareError::Refused(reason)),
            Ok(Ok(Accepted::NotAuthenticated)) => Err(PrepareError::CoordinatorNotAuthenticated),
            Ok(Err(why)) => {
                tracing::warn!("cannot report this worker's progress to the coordinator: {why}");
                Ok(None)
            }
            Err(_) => {
                tracing::warn!(
                    "the coordinator did not answer within {ACCEPT_TIMEOUT:?}; loading without reporting progress"
                );
                Ok(None)
            }
        }
    }

    /// A download's progress (called as bytes arrive; sent at most every [`SEND_EVERY`]).
    pub fn download(&self, download: &DownloadProgress) {
        self.progress.send_modify(|p| p.download = download.clone());
    }

    /// The weights are fetched; they are being loaded now.
    pub fn loading(&self) {
        self.progress.send_modify(|p| p.phase = PreparePhase::Loading);
    }
}

enum Accepted {
    Yes,
    Refused(String),
    NotAuthenticated,
}

async fn report(
    coordinator: &str,
    secret: &str,
    mut preparing: Preparing,
    mut updates: watch::Receiver<PrepareProgress>,
    accepted: std::sync::mpsc::Sender<Result<Accepted, String>>,
) {
    let connected = async {
        let address: SocketAddr = tokio::net::lookup_host(coordinator)
            .await
            .map_err(|e| format!("{coordinator}: {e}"))?
            .next()
            .ok_or_else(|| format!("{coordinator}: no address"))?;
        let endpoint = transport::client_endpoint(address).map_err(|e| e.to_string())?;
        let conn = endpoint
            .connect(address, transport::SERVER_NAME)
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| format!("{address}: {e}"))?;
        let binding = transport::channel_binding(&conn).map_err(|e| e.to_string())?;
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        preparing.auth_tag = transport::auth_tag(secret.as_bytes(), Role::Worker, &binding);
        transport::write_frame(&mut send, &WorkerHello::Prepare(preparing)).await.map_err(|e| e.to_string())?;
        let answer = match transport::read_frame::<OfferReply>(&mut recv).await.map_err(|e| e.to_string())? {
            Some(OfferReply::Accepted { auth_tag }) => {
                if transport::verify_auth_tag(secret.as_bytes(), Role::Coordinator, &binding, &auth_tag) {
                    transport::trust_connection(&conn);
                    Accepted::Yes
                } else {
                    Accepted::NotAuthenticated
                }
            }
            Some(OfferReply::Refused { reason }) => Accepted::Refused(reason),
            Some(other) => return Err(format!("unexpected answer {other:?}")),
            None => return Err("the coordinator closed the connection".into()),
        };
        Ok::<_, String>((endpoint, conn, send, answer))
    };
    let (endpoint, conn, mut send) = match connected.await {
        Ok((endpoint, conn, send, Accepted::Yes)) => {
            let _ = accepted.send(Ok(Accepted::Yes));
            (endpoint, conn, send)
        }
        Ok((_, _, _, answer)) => {
            let _ = accepted.send(Ok(answer));
            return;
        }
        Err(why) => {
            let _ = accepted.send(Err(why));
            return;
        }
    };
    // Send the latest progress whenever it changed, at most every
    // SEND_EVERY, until the worker is ready (the sender is dropped: that
    // ends the report at once) or the coordinator goes away.
    'report: loop {
        if updates.changed().await.is_err() {
            break;
        }
        loop {
            let latest = updates.borrow_and_update().clone();
            if transport::write_frame(&mut send, &latest).await.is_err() {
                break 'report;
            }
            let pause = tokio::time::sleep(SEND_EVERY);
            tokio::pin!(pause);
            let mut changed = false;
            loop {
                tokio::select! {
                    () = &mut pause => break,
                    result = updates.changed() => match result {
                        Ok(()) => changed = true,
                        Err(_) => break 'report,
                    },
                }
            }
            if !changed {
                break;
            }
        }
    }
    let _ = send.finish();
    // Let the end of the stream arrive before the connection goes.
    let _ = tokio::time::timeout(Duration::from_secs(2), conn.closed()).await;
    conn.close(0u32.into(), b"prepared");
    endpoint.wait_idle().await;
}
