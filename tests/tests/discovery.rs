//! Workers on other hosts find the coordinator by themselves (issue 57):
//! the coordinator and a worker each run in a network namespace of their
//! own, joined by veth pairs to a bridge, so the mDNS announcement crosses
//! a real (virtual) link as multicast. The worker is given only a join
//! token without an address; it finds the coordinator by discovery, proves
//! the secret, and serves. A worker whose token carries another cluster's
//! secret is refused with a message, and the cluster is unaffected.
//!
//! Namespaces need root and iproute2. Without them the test says so and
//! skips, except under CI with TINYVLLM_TEST_NETNS=required (`.ci/run`
//! sets it where it can create them), where it fails.

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tinyvllm_tests::{TempDir, binary, terminate};

/// Namespaces, veth pairs and a bridge, removed on drop.
struct Network {
    bridge: String,
    namespaces: Vec<String>,
    /// The /24 every address is in: 10.<n>.<m>.0.
    prefix: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl Network {
    /// Hosts named `hosts` (host i gets address .i+1), and the bridge at .254.
    fn new(hosts: &[&str]) -> Result<Self, String> {
        // Unique per test of this process as well as per process.
        static NETWORKS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let id = std::process::id() * 4 + NETWORKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 4;
        let prefix = format!("10.{}.{}", 100 + id % 100, (id / 100) % 250);
        let mut net = Self { bridge: format!("tvbr{}", id % 100_000), namespaces: Vec::new(), prefix };
        ip(&["link", "add", &net.bridge, "type", "bridge"])?;
        ip(&["addr", "add", &format!("{}.254/24", net.prefix), "dev", &net.bridge])?;
        ip(&["link", "set", &net.bridge, "up"])?;
        for (i, host) in hosts.iter().enumerate() {
            let ns = format!("tv{host}{}", id % 100_000);
            ip(&["netns", "add", &ns])?;
            net.namespaces.push(ns.clone());
            let (outer, inner) = (format!("{ns}o"), format!("{ns}i"));
            ip(&["link", "add", &outer, "type", "veth", "peer", "name", &inner])?;
            ip(&["link", "set", &inner, "netns", &ns])?;
            ip(&["link", "set", &outer, "master", &net.bridge, "up"])?;
            let address = format!("{}.{}/24", net.prefix, i + 1);
            ip(&["netns", "exec", &ns, "ip", "addr", "add", &address, "dev", &inner])?;
            ip(&["netns", "exec", &ns, "ip", "link", "set", &inner, "up", "multicast", "on"])?;
            ip(&["netns", "exec", &ns, "ip", "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    fn address(&self, host: usize) -> String {
        format!("{}.{}", self.prefix, host + 1)
    }

    /// `program args` run inside host `host`'s namespace.
    fn command(&self, host: usize, program: &std::path::Path) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.namespaces[host]]).arg(program);
        command
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for ns in &self.namespaces {
            let _ = ip(&["netns", "delete", ns]);
        }
        let _ = ip(&["link", "delete", &self.bridge]);
    }
}

fn wait_for<T>(what: &str, timeout: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The worker gave up (discovery timed out, or it was refused).
fn start_failed(log: &str) -> bool {
    log.contains("Error:") || log.contains("error:")
}

fn get_json(url: &str) -> Option<serde_json::Value> {
    ureq::get(url).timeout(Duration::from_secs(5)).call().ok()?.into_json().ok()
}

struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        terminate(&mut self.0);
    }
}

/// The coordinator's QUIC socket bound to its host's address: that
/// address alone is announced.
#[test]
fn a_worker_in_another_namespace_joins_by_discovery_and_a_token() {
    joins_by_discovery(Bound::HostAddress);
}

/// Bound to 0.0.0.0 (the default): every IPv4 address of the host is
/// announced, and no IPv6 one (an IPv4 socket cannot be reached there; a
/// worker once dialled an announced link-local IPv6 address and never
/// joined).
#[test]
fn a_coordinator_on_every_address_is_found_at_one_it_listens_on() {
    joins_by_discovery(Bound::Unspecified);
}

#[derive(Clone, Copy, PartialEq)]
enum Bound {
    HostAddress,
    Unspecified,
}

fn joins_by_discovery(bound: Bound) {
    let network = match Network::new(&["c", "w"]) {
        Ok(network) => network,
        Err(why) => {
            let required = std::env::var("TINYVLLM_TEST_NETNS").is_ok_and(|v| v == "required");
            assert!(!required, "network namespaces are required here (TINYVLLM_TEST_NETNS): {why}");
            eprintln!("skipping: cannot create network namespaces here (needs root and iproute2): {why}");
            return;
        }
    };
    let dir = TempDir::new("discovery");
    let secret_file = dir.0.join("secret");
    let coordinator_bin = binary("tinyvllm-coordinator");
    let worker_bin = binary("tinyvllm-worker");

    // The coordinator on host c, announcing itself; no local workers.
    let http = format!("{}:18080", network.address(0));
    let quic_host = match bound {
        Bound::HostAddress => network.address(0),
        Bound::Unspecified => "0.0.0.0".to_string(),
    };
    let coordinator = Process(
        network
            .command(0, &coordinator_bin)
            .args(["--http", &http, "--quic", &format!("{quic_host}:17070")])
            .arg("--cluster-secret-file")
            .arg(&secret_file)
            .stdout(Stdio::null())
            .spawn()
            .expect("coordinator"),
    );
    let workers_url = format!("http://{http}/v1/workers");
    wait_for("the coordinator", Duration::from_secs(60), || get_json(&workers_url));

    // A token without an address: the worker must discover the coordinator.
    let out = Command::new(&coordinator_bin)
        .args(["join-token", "--no-address", "--cluster-secret-file"])
        .arg(&secret_file)
        .output()
        .expect("join-token");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let token = String::from_utf8(out.stdout).expect("utf-8").trim().to_string();
    assert!(token.starts_with("tvj1_"), "{token}");

    let log = dir.0.join("worker.log");
    let worker = Process(
        network
            .command(1, &worker_bin)
            .args(["serve", "--join", &token, "--name", "discovered"])
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("worker"),
    );
    let worker_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let started = Instant::now();
    let workers = wait_for("the discovered worker", Duration::from_secs(120), || {
        if start_failed(&worker_log()) || started.elapsed() > Duration::from_secs(100) {
            panic!("the worker did not join:\n{}", worker_log());
        }
        let workers = get_json(&workers_url)?;
        let ready = workers["data"].as_array()?.iter().any(|w| w["name"] == "discovered" && w["state"] == "ready");
        ready.then_some(workers)
    });
    assert_eq!(workers["data"][0]["joined_by"], "discovery", "{workers}");
    let address = workers["data"][0]["address"].as_str().expect("address").to_string();
    assert!(address.starts_with(&network.address(1)), "joined from host w: {address}");
    let body = serde_json::json!({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0});
    let reply: serde_json::Value = ureq::post(&format!("http://{http}/v1/completions"))
        .send_json(body)
        .expect("completion")
        .into_json()
        .expect("json");
    assert!(reply["choices"][0]["text"].as_str().is_some_and(|t| t.starts_with(", there was")), "{reply}");
    let found = worker_log();
    assert!(found.contains(&format!("found the coordinator at {}:17070", network.address(0))), "{found}");
    if bound == Bound::Unspecified {
        return;
    }

    // Another cluster's token, naming this coordinator: refused, with a message.
    let other = TempDir::new("other-secret");
    std::fs::write(other.0.join("secret"), "b".repeat(64)).expect("secret");
    let out = Command::new(&coordinator_bin)
        .args(["join-token", "--address", &format!("{}:17070", network.address(0)), "--cluster-secret-file"])
        .arg(other.0.join("secret"))
        .output()
        .expect("join-token");
    let wrong = String::from_utf8(out.stdout).expect("utf-8").trim().to_string();
    let mut intruder = network
        .command(1, &worker_bin)
        .args(["serve", "--join", &wrong, "--name", "intruder"])
        .stderr(Stdio::piped())
        .spawn()
        .expect("intruder");
    let status = intruder.wait().expect("intruder exits");
    let mut stderr = String::new();
    intruder.stderr.take().expect("stderr").read_to_string(&mut stderr).expect("stderr");
    assert!(!status.success() && stderr.contains("wrong cluster secret"), "{stderr}");
    // A damaged token is named as such.
    let out =
        network.command(1, &worker_bin).args(["serve", "--join", &token[..token.len() - 3]]).output().expect("run");
    assert!(String::from_utf8_lossy(&out.stderr).contains("join token is damaged"), "{out:?}");
    let workers = get_json(&workers_url).expect("workers");
    let names: Vec<&str> =
        workers["data"].as_array().expect("data").iter().filter_map(|w| w["name"].as_str()).collect();
    assert_eq!(names, ["discovered"]);
    drop(worker);
    drop(coordinator);
}
