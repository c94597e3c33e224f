//! The coordinator's own workers (`--local-workers N`): started as child
//! processes of this binary's sibling `tinyvllm-worker`, restarted when
//! they exit (with backoff), dropped from the cluster at once when they
//! do, and drained with SIGTERM at shutdown, never restarted then.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::cluster::Cluster;

/// A local worker that stayed up this long gets the shortest restart
/// backoff again when it next exits.
const HEALTHY_UPTIME: Duration = Duration::from_secs(60);
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// How long to wait before restarting a local worker: doubling from
/// `FIRST_BACKOFF` up to `MAX_BACKOFF` while it keeps failing, and back to
/// the first once a run lasted `HEALTHY_UPTIME`.
struct RestartBackoff(Duration);

impl RestartBackoff {
    fn new() -> Self {
        Self(FIRST_BACKOFF)
    }

    /// The pause before the next start, after a run that lasted `uptime`.
    fn after_exit(&mut self, uptime: Duration) -> Duration {
        if uptime >= HEALTHY_UPTIME {
            self.0 = FIRST_BACKOFF;
        }
        let pause = self.0;
        self.0 = (self.0 * 2).min(MAX_BACKOFF);
        pause
    }
}

/// Keeps `n` local workers running, restarting any that exit (with backoff,
/// reset after `HEALTHY_UPTIME`), until shutdown; then stops them with
/// SIGTERM (they drain). A worker seen to exit is dropped from the cluster
/// at once, so its requests move without waiting for its stats to stop.
pub async fn supervise(
    cluster: Cluster,
    n: usize,
    model: String,
    coordinator: SocketAddr,
    secret_file: PathBuf,
    extra: Vec<String>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let exe = std::env::current_exe().ok().and_then(|p| p.parent().map(|d| d.join("tinyvllm-worker")));
    let Some(exe) = exe.filter(|p| p.exists()) else {
        tracing::error!("tinyvllm-worker not found next to this binary; cannot start local workers");
        return;
    };
    let mut tasks = Vec::new();
    for i in 0..n {
        let (exe, model, secret_file, extra, mut stop, cluster) =
            (exe.clone(), model.clone(), secret_file.clone(), extra.clone(), stop.clone(), cluster.clone());
        tasks.push(tokio::spawn(async move {
            let mut backoff = RestartBackoff::new();
            let name = format!("local-{i}");
            loop {
                let started = tokio::time::Instant::now();
                let mut child = match tokio::process::Command::new(&exe)
                    .env(common::log::FORMAT_ENV, common::log::format().name())
                    .args([
                        "serve",
                        "--exit-with-parent",
                        "--model",
                        &model,
                        "--coordinator",
                        &coordinator.to_string(),
                        "--name",
                        &name,
                    ])
                    .arg("--cluster-secret-file")
                    .arg(&secret_file)
                    .args(&extra)
                    .kill_on_drop(true)
                    .spawn()
                {
                    Ok(child) => child,
                    Err(e) => {
                        tracing::error!("starting local worker {i}: {e}");
                        return;
                    }
                };
                tokio::select! {
                    status = child.wait() => {
                        let status = match status {
                            Ok(status) => status.to_string(),
                            Err(e) => e.to_string(),
                        };
                        cluster.worker_process_exited(&name, &status);
                        // Stopping (a signal to the whole process group drains
                        // the workers too): no restart.
                        if *stop.borrow() {
                            return;
                        }
                        let pause = backoff.after_exit(started.elapsed());
                        tracing::warn!("local worker {i} exited ({status}); restarting in {pause:?}");
                        tokio::select! {
                            _ = tokio::time::sleep(pause) => {}
                            _ = stop.changed() => return,
                        }
                    }
                    _ = stop.changed() => {
                        if let Some(pid) = child.id() {
                            // SIGTERM: the worker drains, then exits.
                            let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
                        }
                        let _ = tokio::time::timeout(Duration::from_secs(8), child.wait()).await;
                        return;
                    }
                }
            }
        }));
    }
    let _ = stop.changed().await;
    for t in tasks {
        let _ = t.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restart_backoff_doubles_and_resets_after_a_healthy_run() {
        let mut b = RestartBackoff::new();
        let quick = Duration::from_secs(1);
        let pauses: Vec<u64> = (0..7).map(|_| b.after_exit(quick).as_millis() as u64).collect();
        assert_eq!(pauses, [500, 1000, 2000, 4000, 8000, 10_000, 10_000]);
        // A run of a minute or more: the next pause is the shortest again.
        assert_eq!(b.after_exit(HEALTHY_UPTIME), FIRST_BACKOFF);
        assert_eq!(b.after_exit(quick), Duration::from_secs(1));
    }
}
