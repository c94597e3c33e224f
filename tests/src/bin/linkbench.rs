//! `tinyvllm-linkbench`: how our QUIC links carry what a pipeline sends,
//! through impaired links (`tinyvllm_tests::netem`), for each congestion
//! controller and initial RTT (`common::transport::Tuning`). A client sends
//! frames of a size on one stream (as a stage sends activations: a decode
//! step's few KiB, a prefill chunk's MiBs) and waits for the server's
//! one-byte answer before the next; the figure is the time from the first
//! byte sent to the answer, median and 90th percentile.
//!
//! ```text
//! cargo run --release -p tinyvllm-tests --bin tinyvllm-linkbench [-- --quick] [--links loopback,LAN]
//! ```
//!
//! Results and the choice made from them: docs/networks.md.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::transport::{self, Congestion, Tuning};
use tinyvllm_tests::netem::{Link, Profile};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Case {
    label: &'static str,
    bytes: usize,
    count: usize,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    // `--links loopback,LAN`: only the links whose names start so.
    let only: Option<Vec<String>> = args
        .iter()
        .position(|a| a == "--links")
        .and_then(|i| args.get(i + 1))
        .map(|l| l.split(',').map(String::from).collect());
    let scale = if quick { 4 } else { 1 };
    let cases = [
        Case { label: "4 KiB (a decode step)", bytes: 4 << 10, count: 200 / scale },
        Case { label: "1 MiB (a prefill chunk)", bytes: 1 << 20, count: 24 / scale },
        Case { label: "8 MiB (a long prefill chunk)", bytes: 8 << 20, count: 8 / scale },
    ];
    let profiles = [
        ("loopback", Profile::default()),
        ("LAN: 2 +/- 1 ms, 0.1% loss", Profile::lossy(2, 1, 0.001)),
        ("Wi-Fi: 10 +/- 5 ms, 2% loss", Profile::lossy(10, 5, 0.02)),
        ("bad Wi-Fi: 20 +/- 20 ms, 5% loss", Profile::lossy(20, 20, 0.05)),
    ];
    let tunings = [
        ("cubic, 333 ms", Tuning { congestion: Congestion::Cubic, initial_rtt: Duration::from_millis(333) }),
        ("cubic, 10 ms", Tuning { congestion: Congestion::Cubic, initial_rtt: Duration::from_millis(10) }),
        ("newreno, 10 ms", Tuning { congestion: Congestion::NewReno, initial_rtt: Duration::from_millis(10) }),
        ("bbr, 10 ms", Tuning { congestion: Congestion::Bbr, initial_rtt: Duration::from_millis(10) }),
    ];
    println!(
        "| link | tuning | {} |",
        cases.iter().map(|c| format!("{}: median / p90 ms", c.label)).collect::<Vec<_>>().join(" | ")
    );
    println!("|---|---|{}", "---|".repeat(cases.len()));
    for (profile_name, profile) in &profiles {
        if only.as_ref().is_some_and(|only| !only.iter().any(|o| profile_name.starts_with(o.as_str()))) {
            continue;
        }
        for (k, (tuning_name, tuning)) in tunings.iter().enumerate() {
            let mut cells = Vec::new();
            for case in &cases {
                let times = run(*tuning, profile.clone(), 1000 + k as u64, case).await?;
                cells.push(format!("{:.1} / {:.1}", percentile(&times, 0.5), percentile(&times, 0.9)));
            }
            println!("| {profile_name} | {tuning_name} | {} |", cells.join(" | "));
        }
    }
    Ok(())
}

fn percentile(times: &[f64], q: f64) -> f64 {
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// `case.count` frames of `case.bytes` through a fresh link and connection;
/// each frame's milliseconds.
async fn run(tuning: Tuning, profile: Profile, seed: u64, case: &Case) -> Result<Vec<f64>, Box<dyn std::error::Error>> {
    let (cert, key) = transport::self_signed_cert()?;
    let server = quinn::Endpoint::server(transport::server_config_tuned(cert, key, tuning)?, "127.0.0.1:0".parse()?)?;
    let target = server.local_addr()?;
    let link = Link::start("bench", "127.0.0.1:0".parse()?, target, profile, seed)?;
    let serving = tokio::spawn(async move {
        let Some(incoming) = server.accept().await else { return };
        let Ok(conn) = incoming.await else { return };
        transport::trust_connection(&conn);
        let Ok((mut send, mut recv)) = conn.accept_bi().await else { return };
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let Ok(len) = recv.read_u32().await else { return };
            let mut left = len as usize;
            while left > 0 {
                let take = left.min(buf.len());
                if recv.read_exact(&mut buf[..take]).await.is_err() {
                    return;
                }
                left -= take;
            }
            if send.write_all(&[1]).await.is_err() {
                return;
            }
        }
    });
    let mut client = quinn::Endpoint::client("127.0.0.1:0".parse::<SocketAddr>()?)?;
    client.set_default_client_config(transport::client_config_tuned(tuning)?);
    let conn = client.connect(link.address(), transport::SERVER_NAME)?.await?;
    transport::trust_connection(&conn);
    let (mut send, mut recv) = conn.open_bi().await?;
    let payload = Arc::new(vec![7u8; case.bytes]);
    let mut times = Vec::with_capacity(case.count);
    let mut ack = [0u8; 1];
    // One unmeasured frame: the connection's first round trips.
    for i in 0..=case.count {
        let start = Instant::now();
        send.write_u32(case.bytes as u32).await?;
        send.write_all(&payload).await?;
        recv.read_exact(&mut ack).await?;
        if i > 0 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    conn.close(0u32.into(), b"done");
    serving.abort();
    Ok(times)
}
