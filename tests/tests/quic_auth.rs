//! Nothing is held for a QUIC peer that has not authenticated (issue 31):
//! raw quinn clients against the real coordinator binary. A frame announced
//! before the handshake is capped at 64 KiB, a connection that sends nothing
//! is closed after the auth timeout, and past 64 connections waiting to
//! authenticate new ones are refused, while a real worker still joins later.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::transport;
use tinyvllm_tests::{Coordinator, rss_kib};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

fn client() -> quinn::Endpoint {
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().expect("address")).expect("client endpoint");
    endpoint.set_default_client_config(transport::client_config().expect("client config"));
    endpoint
}

async fn connect(endpoint: &quinn::Endpoint, addr: SocketAddr) -> Result<quinn::Connection, String> {
    let connecting = endpoint.connect(addr, transport::SERVER_NAME).map_err(|e| e.to_string())?;
    connecting.await.map_err(|e| e.to_string())
}

#[test]
fn an_oversized_frame_before_authentication_is_dropped_and_not_held() {
    let cluster = Coordinator::start("stories260K", 0, &[]);
    let addr: SocketAddr = cluster.quic.parse().expect("quic address");
    let pid = cluster.child.id();
    runtime().block_on(async {
        let endpoint = client();
        let before = rss_kib(pid);
        let mut conns = Vec::new();
        for _ in 0..12 {
            let conn = connect(&endpoint, addr).await.expect("TLS completes");
            let (mut send, _recv) = conn.open_bi().await.expect("a stream");
            // Announce an 8 MiB frame, then try to send all of it.
            send.write_all(&(8u32 << 20).to_le_bytes()).await.expect("header");
            let payload = vec![7u8; 8 << 20];
            let _ = tokio::time::timeout(Duration::from_secs(2), send.write_all(&payload)).await;
            conns.push(conn);
        }
        for conn in &conns {
            let reason = tokio::time::timeout(Duration::from_secs(3), conn.closed()).await;
            let reason = reason.expect("the coordinator closes the connection");
            assert!(reason.to_string().contains("bad handshake"), "{reason}");
        }
        let after = rss_kib(pid);
        // Before the cap, each connection made the coordinator hold 8 MiB (96 MiB in all).
        assert!(after < before + 16 * 1024, "RSS grew from {before} KiB to {after} KiB");
    });
}

#[test]
fn silent_connections_time_out_and_too_many_are_refused() {
    let cluster = Coordinator::start("stories260K", 0, &[]);
    let addr: SocketAddr = cluster.quic.parse().expect("quic address");
    runtime().block_on(async {
        let endpoint = Arc::new(client());
        // 64 connections finish TLS and send nothing (one sends half a header).
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..64 {
            let endpoint = endpoint.clone();
            set.spawn(async move { connect(&endpoint, addr).await });
        }
        let mut silent = Vec::new();
        while let Some(conn) = set.join_next().await {
            silent.push(conn.expect("task").expect("within the cap, TLS completes"));
        }
        let opened = Instant::now();
        let (mut send, _recv) = silent[0].open_bi().await.expect("a stream");
        send.write_all(&[1, 0]).await.expect("half a header");
        // The 65th is refused while they wait.
        let refused = connect(&endpoint, addr).await;
        assert!(refused.is_err(), "a connection over the cap was accepted");
        // All 64 are closed once the auth timeout (5 s) passes.
        for conn in &silent {
            let closed = tokio::time::timeout(Duration::from_secs(10), conn.closed()).await;
            closed.expect("a silent connection is closed");
        }
        let waited = opened.elapsed();
        assert!(waited < Duration::from_secs(8), "closed only after {waited:?}");
        // Then there is room again.
        connect(&endpoint, addr).await.expect("accepted again once the others timed out");
    });
    // A real worker joins as usual.
    let mut worker = cluster.start_worker("stories260K", "after", &cluster.secret_file);
    cluster.wait_for_workers(1);
    let _ = worker.kill();
    let _ = worker.wait();
}
