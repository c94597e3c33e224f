//! Finding the coordinator on the local network: it announces itself over
//! mDNS/DNS-SD as a `_tinyvllm._udp` service on its QUIC port, and a worker
//! started without `--coordinator` browses for it.
//!
//! Discovery never grants trust: the QUIC handshake still proves the
//! cluster secret both ways. The announcement carries a cluster id derived
//! from the secret (the first eight bytes of a SHA-256 over a fixed label
//! and the secret) so that a worker picks its own cluster's coordinator
//! when several share a network, without the secret itself being sent.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use mdns_sd::{ServiceDaemon, ServiceEvent, ServiceInfo};

/// How long a browse waits for an answer before it asks again.
const REQUERY: Duration = Duration::from_secs(3);

/// The DNS-SD service type.
pub const SERVICE_TYPE: &str = "_tinyvllm._udp.local.";

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("mDNS: {0}")]
    Mdns(#[from] mdns_sd::Error),
    #[error(
        "no coordinator of this cluster answered on the local network in {0:?} (is one running, and does this \
         network pass multicast? Otherwise give --coordinator HOST:PORT or a join token that names it)"
    )]
    NotFound(Duration),
}

/// The id a cluster's announcements carry, from its secret.
pub fn cluster_id(secret: &str) -> String {
    let mut input = b"tinyvllm cluster id\0".to_vec();
    input.extend_from_slice(secret.as_bytes());
    let digest = ring::digest::digest(&ring::digest::SHA256, &input);
    digest.as_ref()[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// A coordinator's announcement, kept alive as long as this is.
pub struct Announcement {
    daemon: ServiceDaemon,
    fullname: String,
}

impl Announcement {
    /// Announces the coordinator listening for workers on `quic_port`,
    /// serving `model`, on every interface's addresses.
    pub fn start(quic_port: u16, model: &str, secret: &str) -> Result<Self, DiscoveryError> {
        let daemon = ServiceDaemon::new()?;
        let host = hostname();
        let instance = format!("tinyvllm-{}-{}", host, std::process::id());
        let properties = [("cluster", cluster_id(secret)), ("model", model.to_string()), ("v", "1".to_string())];
        let info =
            ServiceInfo::new(SERVICE_TYPE, &instance, &format!("{host}.local."), (), quic_port, &properties[..])?
                .enable_addr_auto();
        let fullname = info.get_fullname().to_string();
        daemon.register(info)?;
        Ok(Self { daemon, fullname })
    }
}

impl Drop for Announcement {
    fn drop(&mut self) {
        // Says goodbye on the network, so workers stop waiting for it at once.
        let _ = self.daemon.unregister(&self.fullname).map(|r| r.recv_timeout(Duration::from_millis(500)));
        let _ = self.daemon.shutdown();
    }
}

/// A coordinator found on the network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    pub address: SocketAddr,
    pub model: Option<String>,
}

/// Browses for a coordinator of the cluster `secret` belongs to, for at
/// most `timeout`; prefers an IPv4 address.
pub fn find_coordinator(secret: &str, timeout: Duration) -> Result<Found, DiscoveryError> {
    let daemon = ServiceDaemon::new()?;
    let mut events = daemon.browse(SERVICE_TYPE)?;
    let ours = cluster_id(secret);
    let deadline = Instant::now() + timeout;
    let mut next_query = Instant::now() + REQUERY;
    let found = loop {
        let now = Instant::now();
        if now >= deadline {
            break None;
        }
        // A query sent before this host's multicast membership took effect
        // goes unanswered: browse afresh now and then until an answer comes.
        if now >= next_query {
            let _ = daemon.stop_browse(SERVICE_TYPE);
            events = daemon.browse(SERVICE_TYPE)?;
            next_query = now + REQUERY;
        }
        match events.recv_timeout(deadline.min(next_query).saturating_duration_since(now)) {
            Ok(ServiceEvent::ServiceResolved(info)) if info.get_property_val_str("cluster") == Some(ours.as_str()) => {
                let mut addresses: Vec<IpAddr> = info.get_addresses().iter().copied().collect();
                addresses.sort_by_key(|a| (a.is_ipv6(), a.is_loopback()));
                if let Some(ip) = addresses.first() {
                    let model = info.get_property_val_str("model").map(str::to_string);
                    break Some(Found { address: SocketAddr::new(*ip, info.get_port()), model });
                }
            }
            Ok(_) => {}
            Err(_) if events.is_disconnected() => break None,
            Err(_) => {}
        }
    };
    let _ = daemon.stop_browse(SERVICE_TYPE);
    let _ = daemon.shutdown();
    found.ok_or(DiscoveryError::NotFound(timeout))
}

fn hostname() -> String {
    let raw = std::fs::read_to_string("/etc/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "host".to_string());
    let clean: String =
        raw.trim().chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '-' }).collect();
    if clean.is_empty() { "host".to_string() } else { clean }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_ids_tell_clusters_apart_without_the_secret() {
        let a = cluster_id(&"a".repeat(32));
        assert_eq!(a.len(), 16);
        assert_eq!(a, cluster_id(&"a".repeat(32)));
        assert_ne!(a, cluster_id(&"b".repeat(32)));
        assert!(!a.contains("aaaa"));
    }
}
