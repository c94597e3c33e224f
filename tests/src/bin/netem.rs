//! `tinyvllm-netem`: one impaired UDP link as a process (`tinyvllm_tests::netem`),
//! for `tools/soak.py --faults` and for trying a cluster over a bad network
//! by hand:
//!
//! ```text
//! tinyvllm-netem --listen 127.0.0.1:7071 --target 127.0.0.1:7070 --seed 1 delay_ms=10 jitter_ms=5 loss=0.02
//! ```
//!
//! then point a worker at 127.0.0.1:7071. Commands on stdin, one a line:
//! `cut`, `restore`, `set WORDS` (as on the command line), `counts`. The
//! fault log (cuts, restores, profile changes, a count line every 10 s) goes
//! to stderr with timestamps.

use std::io::BufRead;
use std::net::SocketAddr;
use std::time::Duration;

use tinyvllm_tests::netem::{Link, Profile};

fn main() {
    if let Err(e) = run() {
        eprintln!("tinyvllm-netem: {e}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), String> {
    let mut listen: Option<SocketAddr> = None;
    let mut target: Option<SocketAddr> = None;
    let mut seed = 1u64;
    let mut words = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--listen" => listen = Some(value("--listen")?.parse().map_err(|e| format!("--listen: {e}"))?),
            "--target" => target = Some(value("--target")?.parse().map_err(|e| format!("--target: {e}"))?),
            "--seed" => seed = value("--seed")?.parse().map_err(|e| format!("--seed: {e}"))?,
            "-h" | "--help" => {
                println!(
                    "tinyvllm-netem --listen ADDR --target ADDR [--seed N] [delay_ms=.. jitter_ms=.. loss=.. burst=P_ENTER,P_LEAVE reorder=.. duplicate=.. rate_mbps=..]"
                );
                return Ok(());
            }
            word => words.push(word.to_string()),
        }
    }
    let mut profile = Profile::default();
    profile.apply(&words.join(" "))?;
    let link = Link::start(
        "link",
        listen.ok_or("--listen is required")?,
        target.ok_or("--target is required")?,
        profile,
        seed,
    )
    .map_err(|e| e.to_string())?;
    // The first line says where it listens, for scripts.
    println!("tinyvllm-netem listening={}", link.address());
    let printed = std::sync::Arc::new(std::sync::Mutex::new(0usize));
    let shown = printed.clone();
    let link = std::sync::Arc::new(link);
    let watched = link.clone();
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(Duration::from_millis(200));
            flush_log(&watched, &shown);
        }
    });
    let counter = link.clone();
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(Duration::from_secs(10));
            eprintln!("{:?}", counter.counts());
        }
    });
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        let line = line.trim();
        match line.split_once(' ').map_or((line, ""), |(a, b)| (a, b)) {
            ("cut", _) => link.cut(),
            ("restore", _) => link.restore(),
            ("counts", _) => println!("{:?}", link.counts()),
            ("set", words) => {
                let mut profile = link.profile();
                match profile.apply(words) {
                    Ok(()) => link.set_profile(profile),
                    Err(e) => eprintln!("set: {e}"),
                }
            }
            ("", _) => {}
            (other, _) => eprintln!("unknown command {other:?} (cut, restore, set WORDS, counts)"),
        }
        flush_log(&link, &printed);
    }
    // Stdin closed: keep forwarding until killed.
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// Writes the fault log's new lines to stderr.
fn flush_log(link: &Link, printed: &std::sync::Mutex<usize>) {
    let mut printed = printed.lock().unwrap_or_else(|p| p.into_inner());
    let log = link.log();
    for line in &log[*printed..] {
        eprintln!("{line}");
    }
    *printed = log.len();
}
