//! What an operator reads and types (issue 32's new-user findings): host
//! names work in every bind and connect address, every log line carries a
//! UTC timestamp and the name of the process that wrote it (so interleaved
//! logs of several workers can be told apart), and a worker that cannot
//! reach its coordinator says which address it is trying.

use std::time::Duration;

use serde_json::json;
use tinyvllm_tests::{Coordinator, Log, binary, model_dir, post_json, terminate};

/// `2026-11-26T07:40:01.123Z ` at the start of `line`.
fn starts_with_timestamp(line: &str) -> bool {
    let b = line.as_bytes();
    let digits = |range: std::ops::Range<usize>| range.into_iter().all(|i| b.get(i).is_some_and(u8::is_ascii_digit));
    b.len() > 25
        && digits(0..4)
        && b[4] == b'-'
        && digits(5..7)
        && b[7] == b'-'
        && digits(8..10)
        && b[10] == b'T'
        && digits(11..13)
        && b[13] == b':'
        && digits(14..16)
        && b[16] == b':'
        && digits(17..19)
        && b[19] == b'.'
        && digits(20..23)
        && &b[23..25] == b"Z "
}

#[test]
fn host_names_bind_and_connect_and_log_lines_say_when_and_who() {
    let (coordinator, log) = Coordinator::start_logged_at(("localhost:0", "localhost:0"), "stories260K", 0, &[]);
    // `quic=` is the bound address; the worker dials it by host name.
    let port = coordinator.quic.rsplit(':').next().expect("a port");
    let mut worker = std::process::Command::new(binary("tinyvllm-worker"))
        .args(["serve", "--model", model_dir("stories260K").to_str().expect("utf-8 path")])
        .args(["--coordinator", &format!("localhost:{port}"), "--metrics", "localhost:0", "--name", "w-host"])
        .arg("--cluster-secret-file")
        .arg(&coordinator.secret_file)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting a worker");
    let worker_log = Log::collect(worker.stderr.take().expect("piped stderr"));
    coordinator.wait_for_workers(1);

    let (status, out) = post_json(&coordinator.url("/generate"), &json!({"prompt": "Once upon", "max_tokens": 4}));
    assert_eq!(status, 200, "{out}");

    let registered = log.wait_for("registered as", Duration::from_secs(5)).expect("a registration line");
    assert!(starts_with_timestamp(&registered), "{registered}");
    assert!(registered.contains(" coordinator: worker \"w-host\" at "), "{registered}");
    let joined = worker_log.wait_for("registered with the coordinator at", Duration::from_secs(5)).expect("joined");
    assert!(starts_with_timestamp(&joined) && joined.contains(" worker w-host: "), "{joined}");
    let metrics = worker_log.wait_for("metrics on http://", Duration::from_secs(5)).expect("metrics line");
    assert!(metrics.contains(" worker w-host: "), "{metrics}");
    for line in log.text().lines().chain(worker_log.text().lines()) {
        assert!(starts_with_timestamp(line), "an untimed line: {line:?}");
    }
    terminate(&mut worker);
}

#[test]
fn a_worker_that_cannot_connect_names_the_address() {
    let dir = tinyvllm_tests::TempDir::new("no-coordinator");
    let secret = dir.0.join("secret");
    std::fs::write(&secret, "0123456789abcdef0123456789abcdef").expect("secret");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    }
    // A UDP socket that never answers: the QUIC handshake times out.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp");
    let closed = silent.local_addr().expect("addr");
    let mut worker = std::process::Command::new(binary("tinyvllm-worker"))
        .args(["serve", "--model", model_dir("stories260K").to_str().expect("utf-8 path")])
        .args(["--coordinator", &format!("localhost:{}", closed.port()), "--name", "w-lonely"])
        .arg("--cluster-secret-file")
        .arg(&secret)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting a worker");
    let log = Log::collect(worker.stderr.take().expect("piped stderr"));
    let line = log.wait_for("retrying in", Duration::from_secs(40)).unwrap_or_else(|| log.text());
    terminate(&mut worker);
    assert!(
        line.contains(&format!("connecting to the coordinator at 127.0.0.1:{}", closed.port()))
            || line.contains(&format!("connecting to the coordinator at [::1]:{}", closed.port())),
        "{line}"
    );
    assert!(starts_with_timestamp(&line) && line.contains(" worker w-lonely: "), "{line}");
}
