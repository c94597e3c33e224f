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

use mdns_sd::{IfKind, ServiceDaemon, ServiceEvent, ServiceInfo};

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
    /// Announces the coordinator listening for workers on `quic`, serving
    /// `model`, with the addresses a worker can reach that socket at: the
    /// bound address alone, or for an unspecified one every interface's
    /// addresses of its family (IPv4 only for 0.0.0.0).
    pub fn start(quic: SocketAddr, model: &str, secret: &str) -> Result<Self, DiscoveryError> {
        let daemon = ServiceDaemon::new()?;
        let host = hostname();
        let instance = format!("tinyvllm-{}-{}", host, std::process::id());
        let properties = [("cluster", cluster_id(secret)), ("model", model.to_string()), ("v", "1".to_string())];
        let hostname = format!("{host}.local.");
        let info = match quic.ip() {
            ip if ip.is_unspecified() => {
                if ip.is_ipv4() {
                    // An IPv4 socket: an IPv6 address would lead workers nowhere.
                    daemon.disable_interface(IfKind::IPv6)?;
                }
                ServiceInfo::new(SERVICE_TYPE, &instance, &hostname, (), quic.port(), &properties[..])?
                    .enable_addr_auto()
            }
            ip => {
                daemon.disable_interface(IfKind::All)?;
                daemon.enable_interface(IfKind::Addr(ip))?;
                ServiceInfo::new(SERVICE_TYPE, &instance, &hostname, ip, quic.port(), &properties[..])?
            }
        };
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
                // The records may come one by one: wait for a usable address.
                if let Some(ip) = best_address(info.get_addresses().iter().copied()) {
                    let model = info.get_property_val_str("model").map(str::to_string);
                    break Some(Found { address: SocketAddr::new(ip, info.get_port()), model });
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

/// The address to dial of those announced: IPv4 first, then not loopback.
/// An IPv6 link-local address is of no use without its interface, which
/// an mDNS answer does not say, and an unspecified one never is.
fn best_address(addresses: impl Iterator<Item = IpAddr>) -> Option<IpAddr> {
    let usable = |ip: &IpAddr| match ip {
        IpAddr::V4(v4) => !v4.is_unspecified(),
        IpAddr::V6(v6) => !v6.is_unspecified() && !v6.is_unicast_link_local(),
    };
    addresses.filter(usable).min_by_key(|ip| (ip.is_ipv6(), ip.is_loopback(), *ip))
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

    /// A resolved service whose only address so far is IPv6 link-local
    /// is not yet found (the A record may follow); IPv4 wins over IPv6.
    #[test]
    fn only_a_usable_address_is_dialled() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(best_address([ip("fe80::8801:66ff:fe14:1ca9")].into_iter()), None);
        assert_eq!(best_address([ip("0.0.0.0"), ip("::")].into_iter()), None);
        let mixed = [ip("fe80::1"), ip("2001:db8::5"), ip("10.0.0.7"), ip("127.0.0.1")];
        assert_eq!(best_address(mixed.into_iter()), Some(ip("10.0.0.7")));
        assert_eq!(best_address([ip("fe80::1"), ip("2001:db8::5")].into_iter()), Some(ip("2001:db8::5")));
    }

    #[test]
    fn cluster_ids_tell_clusters_apart_without_the_secret() {
        let a = cluster_id(&"a".repeat(32));
        assert_eq!(a.len(), 16);
        assert_eq!(a, cluster_id(&"a".repeat(32)));
        assert_ne!(a, cluster_id(&"b".repeat(32)));
        assert!(!a.contains("aaaa"));
    }
}
