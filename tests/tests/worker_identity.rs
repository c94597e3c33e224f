//! A worker's stable id (issue 57): kept in its state directory across
//! restarts, shown in /v1/workers, and unique in a cluster: a second worker
//! started on the same state directory under the same name (a copied
//! config) is refused with a message while the first is connected. A
//! directory copied to another machine is renewed by the worker itself
//! (unit-tested in `worker/src/cli/identity.rs`, which fakes the machine).

use std::io::Read;
use std::time::{Duration, Instant};

use tinyvllm_tests::{Coordinator, TempDir};

fn instance_id(cluster: &Coordinator, name: &str) -> Option<String> {
    let workers = cluster.workers();
    workers["data"].as_array()?.iter().find(|w| w["name"] == name)?["instance_id"].as_str().map(str::to_string)
}

#[test]
fn a_worker_keeps_its_id_and_a_copy_is_refused() {
    let cluster = Coordinator::start("stories260K", 0, &[]);
    let state = TempDir::new("worker-state");
    let state_dir = state.0.to_str().expect("path");
    let mut first = cluster.start_worker_with("stories260K", "twin", &cluster.secret_file, &["--state-dir", state_dir]);
    cluster.wait_for_workers(1);
    let id = instance_id(&cluster, "twin").expect("the worker's id");
    assert_eq!(id.len(), 16, "{id}");

    // The same state directory and name: the same id, refused while the first is connected.
    let mut copy = cluster.start_worker_with("stories260K", "twin", &cluster.secret_file, &["--state-dir", state_dir]);
    let status = copy.wait().expect("the copy exits");
    let mut stderr = String::new();
    copy.stderr.take().expect("stderr").read_to_string(&mut stderr).expect("stderr");
    assert!(!status.success() && stderr.contains("has the same id"), "{stderr}");
    assert_eq!(cluster.workers()["data"].as_array().map(Vec::len), Some(1));

    // Restarted, the worker comes back with its id.
    first.kill().expect("kill");
    first.wait().expect("wait");
    let start = Instant::now();
    while instance_id(&cluster, "twin").is_some() {
        assert!(start.elapsed() < Duration::from_secs(30), "the killed worker never left");
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut again = cluster.start_worker_with("stories260K", "twin", &cluster.secret_file, &["--state-dir", state_dir]);
    cluster.wait_for_workers(1);
    assert_eq!(instance_id(&cluster, "twin"), Some(id));
    let _ = again.kill();
    let _ = again.wait();
}
