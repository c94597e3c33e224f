//! `tinyvllm-coordinator join-token`: prints the one string a worker needs
//! to join this cluster (`tinyvllm-worker serve --join TOKEN`): the cluster
//! secret, created as the coordinator would create it if missing, and the
//! address workers reach the coordinator at (see `common::join`).

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::PathBuf;

use common::join::JoinToken;

#[derive(clap::Args, Debug)]
pub struct JoinTokenArgs {
    /// The cluster secret's file, as given to the coordinator (created if missing).
    #[arg(long, default_value = "tinyvllm-cluster-secret", env = "TINYVLLM_CLUSTER_SECRET_FILE")]
    pub cluster_secret_file: PathBuf,
    /// The coordinator's QUIC address as workers reach it, HOST:PORT (default:
    /// this machine's address on its network, port 7070, the default --quic port).
    #[arg(long)]
    pub address: Option<String>,
    /// Leave the address out: workers find the coordinator by discovery on
    /// the local network.
    #[arg(long, conflicts_with = "address")]
    pub no_address: bool,
}

/// The token for `args`, the secret read (or created) with `load_secret`.
pub fn token(args: &JoinTokenArgs, secret: String) -> anyhow::Result<String> {
    let coordinator = match (&args.address, args.no_address) {
        (_, true) => None,
        (Some(address), false) => Some(address.clone()),
        (None, false) => Some(SocketAddr::new(network_address(), 7070).to_string()),
    };
    Ok(JoinToken { secret, coordinator }.encode()?)
}

/// This machine's address on the network its default route leads to (no
/// packet is sent: connecting a UDP socket only picks the interface), else
/// loopback.
fn network_address() -> IpAddr {
    let probe = || -> std::io::Result<IpAddr> {
        let socket = UdpSocket::bind("0.0.0.0:0")?;
        socket.connect("192.0.2.1:9")?; // TEST-NET-1: routed like any outside address, never reached
        Ok(socket.local_addr()?.ip())
    };
    probe().ok().filter(|ip| !ip.is_unspecified()).unwrap_or(IpAddr::from([127, 0, 0, 1]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_carries_the_secret_and_the_address() {
        let args = JoinTokenArgs {
            cluster_secret_file: "x".into(),
            address: Some("mac.local:7070".into()),
            no_address: false,
        };
        let token = token(&args, "s".repeat(32)).unwrap();
        let read = JoinToken::decode(&token).unwrap();
        assert_eq!((read.secret.len(), read.coordinator.as_deref()), (32, Some("mac.local:7070")));
        let bare = JoinTokenArgs { address: None, no_address: true, ..args };
        assert_eq!(JoinToken::decode(&super::token(&bare, "s".repeat(32)).unwrap()).unwrap().coordinator, None);
        let guessed = JoinTokenArgs { address: None, no_address: false, ..bare };
        let address = JoinToken::decode(&super::token(&guessed, "s".repeat(32)).unwrap()).unwrap().coordinator;
        assert!(address.is_some_and(|a| a.ends_with(":7070")));
    }
}
