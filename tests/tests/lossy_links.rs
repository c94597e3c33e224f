//! Pipelines over the links Macs really have (issue 58): every hop, the
//! coordinator to the first stage and each stage to the next, goes through
//! a seeded impairment proxy (`tinyvllm_tests::netem`) with loss, delay and
//! jitter, and the real QUIC links of real worker processes must still give
//! transformers' golden tokens exactly. A stage link cut for 3 s and
//! restored resumes its streams with no token lost or repeated.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tinyvllm_tests::netem::{Link, Profile};
use tinyvllm_tests::{
    Coordinator, Log, TempDir, binary, golden, greedy, greedy_texts, model_dir, post_json, streams_across, terminate,
};

const MODEL: &str = "stories260K";

struct Stage {
    child: Child,
    log: Log,
}

impl Drop for Stage {
    fn drop(&mut self) {
        terminate(&mut self.child);
    }
}

/// A pipeline of `layers` (e.g. ["0-2", "3-4"]) whose every hop is an
/// impaired link: `links[0]` is the coordinator's, `links[k]` the one
/// into stage `k`.
struct LossyPipeline {
    stages: Vec<Stage>,
    links: Vec<Link>,
    _dir: TempDir,
}

impl LossyPipeline {
    fn start(cluster: &Coordinator, layers: &[&str], profile: &Profile, seed: u64) -> Self {
        let dir = TempDir::new("lossy");
        let mut stages = Vec::new();
        let mut links: Vec<Link> = Vec::new();
        let mut next: Option<SocketAddr> = None;
        // The last stage first: each stage dials the link in front of the next.
        for (k, range) in layers.iter().enumerate().rev() {
            let mut command = Command::new(binary("tinyvllm-worker"));
            command
                .args(["serve", "--model", model_dir(MODEL).to_str().unwrap(), "--layers", range])
                .args(["--name", &format!("stage-{k}"), "--kv-cache-memory", "4000000"])
                .arg("--cluster-secret-file")
                .arg(&cluster.secret_file)
                .stderr(Stdio::piped());
            if let Some(next) = next {
                command.args(["--next-stage", &next.to_string()]);
            }
            let address_file = dir.0.join(format!("stage-{k}.addr"));
            if k > 0 {
                command.args(["--stage-listen", "127.0.0.1:0"]).arg("--stage-address-file").arg(&address_file);
            } else {
                let target: SocketAddr = cluster.quic.parse().expect("the coordinator's QUIC address");
                let link = Link::start("coordinator", localhost(), target, profile.clone(), seed).expect("a link");
                command.args(["--coordinator", &link.address().to_string()]);
                links.insert(0, link);
            }
            let mut child = command.spawn().expect("starting a stage");
            let log = Log::collect(child.stderr.take().expect("stderr"));
            let stage = Stage { child, log };
            if k > 0 {
                let address = wait_for_file(&address_file, &stage);
                let link = Link::start(&format!("stage-{k}"), localhost(), address, profile.clone(), seed + k as u64)
                    .expect("a link");
                next = Some(link.address());
                links.insert(0, link);
            }
            stages.insert(0, stage);
        }
        Self { stages, links, _dir: dir }
    }

    fn logs(&self) -> String {
        let stages = self.stages.iter().map(|s| s.log.text());
        let links = self.links.iter().map(|l| format!("{}\n{:?}", l.log().join("\n"), l.counts()));
        stages.chain(links).collect::<Vec<_>>().join("\n")
    }
}

/// Four story openings, one a stream.
fn four_prompts() -> Vec<String> {
    ["dog", "cat", "girl", "boy"].iter().map(|a| format!("Once upon a time, there was a {a}")).collect()
}

fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().expect("literal")
}

fn wait_for_file(file: &std::path::Path, stage: &Stage) -> SocketAddr {
    for _ in 0..600 {
        if let Some(address) = std::fs::read_to_string(file).ok().and_then(|a| a.trim().parse().ok()) {
            return address;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("the stage never listened: {}", stage.log.text());
}

fn wait_ready(cluster: &Coordinator, pipeline: &mut LossyPipeline) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        if pipeline.stages.iter_mut().any(|s| s.child.try_wait().ok().flatten().is_some()) {
            panic!("a stage exited: {}", pipeline.logs());
        }
        let workers = cluster.workers();
        if workers["data"].as_array().is_some_and(|d| d.len() == 1 && d[0]["state"] == "ready") {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("the pipeline never became ready: {}", pipeline.logs());
}

/// 2% loss and 10 +/- 5 ms each way on every hop.
fn lan_profile() -> Profile {
    Profile::lossy(10, 5, 0.02)
}

fn goldens_over(layers: &[&str], seed: u64) {
    let cluster = Coordinator::start(MODEL, 0, &[]);
    let mut pipeline = LossyPipeline::start(&cluster, layers, &lan_profile(), seed);
    wait_ready(&cluster, &mut pipeline);
    for case in golden(&format!("{MODEL}.json"))["cases"].as_array().expect("cases") {
        let prompt = case["prompt_text"].as_str().unwrap();
        let (status, out) = post_json(&cluster.url("/generate"), &greedy(prompt, 48));
        assert_eq!(status, 200, "{out}\n{}", pipeline.logs());
        assert_eq!(out["token_ids"], case["generated_ids"], "case {}\n{}", case["id"], pipeline.logs());
    }
    // The links did drop datagrams, and no worker was declared lost.
    let lost: u64 = pipeline.links.iter().map(|l| l.counts().lost).sum();
    assert!(lost > 0, "{}", pipeline.logs());
    let workers = cluster.workers();
    assert_eq!(workers["data"][0]["id"], 0, "registered once, never lost: {workers}");
    assert_eq!(workers["redispatches"], 0, "{workers}");
}

#[test]
fn two_stages_over_lossy_jittery_links_give_the_goldens() {
    goldens_over(&["0-2", "3-4"], 11);
}

#[test]
fn three_stages_over_lossy_jittery_links_give_the_goldens() {
    goldens_over(&["0-1", "2-3", "4-4"], 23);
}

/// Streams cross a 3 s cut of the link between the stages: they stall,
/// then resume, each exactly the tokens of an unimpaired run.
#[test]
fn a_stage_link_cut_for_3_s_resumes_losing_no_token() {
    let cluster = Coordinator::start(MODEL, 0, &[]);
    let mut pipeline = LossyPipeline::start(&cluster, &["0-2", "3-4"], &Profile::lossy(2, 1, 0.0), 5);
    wait_ready(&cluster, &mut pipeline);
    let prompts = four_prompts();
    let reference = greedy_texts(&cluster, &prompts, 300);
    let stage_link = &pipeline.links[1];
    let texts = streams_across(&cluster, &prompts, 300, || {
        stage_link.cut();
        std::thread::sleep(Duration::from_secs(3));
        stage_link.restore();
    });
    assert_eq!(texts, reference, "{}", pipeline.logs());
    assert!(stage_link.counts().cut > 0, "the cut dropped datagrams: {:?}", stage_link.counts());
    let workers = cluster.workers();
    assert_eq!(workers["data"][0]["id"], 0, "the pipeline was never lost: {workers}");
}

/// A pipeline the coordinator forms from `--layers auto` offers, each
/// worker reachable only through its own impaired link: it advertises the
/// link's address (`--advertise`), the coordinator hands that to the stage
/// before, and the stage link runs through it.
#[test]
fn a_formed_pipeline_links_through_advertised_addresses() {
    let cluster = Coordinator::start(MODEL, 0, &["--pipeline-parallel-size", "2"]);
    let target: SocketAddr = cluster.quic.parse().expect("the coordinator's QUIC address");
    let coordinator_link = Link::start("coordinator", localhost(), target, lan_profile(), 31).expect("a link");
    let mut links = Vec::new();
    let mut stages = Vec::new();
    for (k, name) in ["a", "b"].into_iter().enumerate() {
        // A free port for the stage listener, then the link in front of it.
        let port = std::net::UdpSocket::bind("127.0.0.1:0").and_then(|s| s.local_addr()).expect("a free port").port();
        let listen: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let link = Link::start(name, localhost(), listen, lan_profile(), 40 + k as u64).expect("a link");
        let mut child = Command::new(binary("tinyvllm-worker"))
            .args(["serve", "--model", model_dir(MODEL).to_str().unwrap(), "--layers", "auto", "--name", name])
            .args(["--coordinator", &coordinator_link.address().to_string()])
            .args(["--stage-listen", &listen.to_string(), "--advertise", &link.address().to_string()])
            .args(["--kv-cache-memory", "4000000"])
            .arg("--cluster-secret-file")
            .arg(&cluster.secret_file)
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting a worker");
        let log = Log::collect(child.stderr.take().expect("stderr"));
        stages.push(Stage { child, log });
        links.push(link);
    }
    let mut pipeline = LossyPipeline { stages, links, _dir: TempDir::new("advertised") };
    wait_ready(&cluster, &mut pipeline);
    let workers = cluster.workers();
    let later = workers["data"][0]["stages"][1]["name"].as_str().expect("a later stage").to_string();
    for case in golden(&format!("{MODEL}.json"))["cases"].as_array().expect("cases") {
        let (status, out) = post_json(&cluster.url("/generate"), &greedy(case["prompt_text"].as_str().unwrap(), 48));
        assert_eq!(status, 200, "{out}");
        assert_eq!(out["token_ids"], case["generated_ids"], "case {}\n{}", case["id"], pipeline.logs());
    }
    // The stage link ran through the later stage's advertised link.
    let through = pipeline.links[if later == "a" { 0 } else { 1 }].counts();
    assert!(through.forwarded > 100 && through.lost > 0, "{through:?}\n{}", pipeline.logs());
    drop(coordinator_link);
}

/// A stage link cut for longer than QUIC's idle timeout (10 s) is a lost
/// pipeline, as a dead stage is: its first stage leaves the cluster and its
/// streams move to a replica, each still exactly its unimpaired run.
#[test]
fn a_stage_link_cut_past_the_timeout_fails_over_losing_no_token() {
    let cluster = Coordinator::start(MODEL, 0, &[]);
    // 10 ms each way on the stage link: about 21 ms a token, so the streams are still running at the cut.
    let mut pipeline = LossyPipeline::start(&cluster, &["0-2", "3-4"], &Profile::lossy(10, 0, 0.0), 9);
    wait_ready(&cluster, &mut pipeline);
    let prompts = four_prompts();
    let reference = greedy_texts(&cluster, &prompts, 200);
    // The streams start on the pipeline, the only worker; then a replica
    // joins, and the stage link goes dark for good.
    let mut replica = None;
    let texts = streams_across(&cluster, &prompts, 200, || {
        replica = Some(cluster.start_worker(MODEL, "replica", &cluster.secret_file));
        pipeline.links[1].cut();
    });
    assert_eq!(texts, reference, "{}", pipeline.logs());
    let workers = cluster.workers();
    assert!(workers["redispatches"].as_u64() >= Some(4), "the pipeline's streams moved: {workers}");
    let names: Vec<&str> = workers["data"].as_array().unwrap().iter().filter_map(|w| w["name"].as_str()).collect();
    assert_eq!(names, ["replica"], "the pipeline left: {workers}");
    terminate(replica.as_mut().expect("the replica"));
}
