//! A worker's stable id (issue 57): kept in its state directory across
//! restarts, shown in /v1/workers, and unique in a cluster: a second worker
//! started on the same state directory under the same name (a copied
//! config, or the worker itself restarted before its old session was
//! noticed gone) is held off with a message while the first is connected,
//! retrying, and joins once the first has gone. A
//! directory copied to another machine is renewed by the worker itself
//! (unit-tested in `worker/src/cli/identity.rs`, which fakes the machine).

use std::time::{Duration, Instant};

use tinyvllm_tests::{Coordinator, TempDir};

fn instance_id(cluster: &Coordinator, name: &str) -> Option<String> {
    let workers = cluster.workers();
    workers["data"].as_array()?.iter().find(|w| w["name"] == name)?["instance_id"].as_str().map(str::to_string)
}

#[test]
fn a_worker_keeps_its_id_and_a_copy_waits_its_turn() {
    let cluster = Coordinator::start("stories260K", 0, &[]);
    let state = TempDir::new("worker-state");
    let state_dir = state.0.to_str().expect("path");
    let mut first = cluster.start_worker_with("stories260K", "twin", &cluster.secret_file, &["--state-dir", state_dir]);
    cluster.wait_for_workers(1);
    let id = instance_id(&cluster, "twin").expect("the worker's id");
    assert_eq!(id.len(), 16, "{id}");

    // The same state directory and name: the same id, held off while the first is connected.
    let mut copy = cluster.start_worker_with("stories260K", "twin", &cluster.secret_file, &["--state-dir", state_dir]);
    let log = tinyvllm_tests::Log::collect(copy.stderr.take().expect("stderr"));
    assert!(log.wait_for("has the same id", Duration::from_secs(60)).is_some(), "{}", log.text());
    std::thread::sleep(Duration::from_secs(1));
    assert!(copy.try_wait().expect("a status").is_none(), "it retries, it does not exit: {}", log.text());
    assert_eq!(cluster.workers()["data"].as_array().map(Vec::len), Some(1));

    // The first one killed (a restart, say): once it is noticed gone, the
    // waiting one joins with the id.
    first.kill().expect("kill");
    first.wait().expect("wait");
    let start = Instant::now();
    loop {
        let workers = cluster.workers();
        let twins: Vec<&serde_json::Value> =
            workers["data"].as_array().expect("data").iter().filter(|w| w["name"] == "twin").collect();
        if twins.len() == 1 && twins[0]["id"] != 0 {
            assert_eq!(twins[0]["instance_id"].as_str(), Some(id.as_str()));
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "the waiting worker never joined: {}", log.text());
        std::thread::sleep(Duration::from_millis(100));
    }
    let again = copy;
    let mut again = again;
    let _ = again.kill();
    let _ = again.wait();
}
