//! QUIC plumbing shared by the coordinator and the workers: TLS configs,
//! framed message I/O on quinn streams, and the cluster-secret handshake.
//!
//! Authentication: the coordinator's certificate is self-signed, so the
//! worker does not check it against a CA (it still checks the handshake
//! signature, proving the peer holds the certificate's key). Instead both
//! sides prove they know the cluster secret with an HMAC over keying
//! material exported from *this* TLS session (RFC 5705 channel binding). A
//! man in the middle terminates two different TLS sessions, so it can
//! neither forward a worker's tag nor forge one; and the secret itself never
//! crosses the network.

use std::sync::Arc;

use serde::{Serialize, de::DeserializeOwned};

use crate::protocol::{self, FRAME_HEADER_BYTES, MAX_FRAME_BYTES, ProtocolError};

/// ALPN protocol id of the cluster's QUIC connections.
pub const ALPN: &[u8] = b"tinyvllm/1";
/// Name the worker asks for in TLS; the self-signed cert carries it.
pub const SERVER_NAME: &str = "tinyvllm-coordinator";

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error("stream read: {0}")]
    Read(#[from] quinn::ReadExactError),
    #[error("stream write: {0}")]
    Write(#[from] quinn::WriteError),
    #[error("TLS setup: {0}")]
    Tls(String),
    #[error("certificate generation: {0}")]
    Cert(#[from] rcgen::Error),
    #[error("UDP socket: {0}")]
    Socket(#[from] std::io::Error),
}

/// Writes one message as a length-prefixed frame.
pub async fn write_frame<T: Serialize>(send: &mut quinn::SendStream, message: &T) -> Result<(), TransportError> {
    let frame = protocol::encode_frame(message)?;
    send.write_all(&frame).await?;
    Ok(())
}

/// Reads one frame; `Ok(None)` when the peer finished the stream cleanly
/// between frames. An oversized length is refused before allocating.
///
/// Not cancel-safe: a frame half read when the future is dropped is lost,
/// so never race it in a `select!` loop; give the stream a reader task.
pub async fn read_frame<T: DeserializeOwned>(recv: &mut quinn::RecvStream) -> Result<Option<T>, TransportError> {
    read_frame_within(recv, MAX_FRAME_BYTES).await
}

/// `read_frame` with a smaller size limit, for a peer that has not
/// authenticated yet (`protocol::MAX_HELLO_FRAME_BYTES`).
pub async fn read_frame_within<T: DeserializeOwned>(
    recv: &mut quinn::RecvStream,
    limit: usize,
) -> Result<Option<T>, TransportError> {
    let mut header = [0u8; FRAME_HEADER_BYTES];
    match recv.read_exact(&mut header).await {
        Ok(()) => {}
        Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = protocol::frame_len_within(header, limit)?;
    let mut payload = vec![0u8; len];
    recv.read_exact(&mut payload).await?;
    if limit <= protocol::MAX_HELLO_FRAME_BYTES {
        return Ok(Some(protocol::decode_small_payload(&payload)?));
    }
    Ok(Some(protocol::decode_payload(&payload)?))
}

/// A self-signed certificate and key for the coordinator.
pub fn self_signed_cert()
-> Result<(rustls::pki_types::CertificateDer<'static>, rustls::pki_types::PrivateKeyDer<'static>), TransportError> {
    let cert = rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_string()])?;
    let key = rustls::pki_types::PrivatePkcs8KeyDer::from(cert.signing_key.serialize_der());
    Ok((cert.cert.der().clone(), key.into()))
}

/// A certificate chain and key from PEM files (`--tls-cert`, `--tls-key`).
pub fn pem_cert(
    cert_path: &std::path::Path,
    key_path: &std::path::Path,
) -> Result<(rustls::pki_types::CertificateDer<'static>, rustls::pki_types::PrivateKeyDer<'static>), TransportError> {
    use rustls::pki_types::pem::PemObject;
    let cert = rustls::pki_types::CertificateDer::from_pem_file(cert_path)
        .map_err(|e| TransportError::Tls(format!("{}: {e}", cert_path.display())))?;
    let key = rustls::pki_types::PrivateKeyDer::from_pem_file(key_path)
        .map_err(|e| TransportError::Tls(format!("{}: {e}", key_path.display())))?;
    Ok((cert, key))
}

/// Bytes a connection may have in flight to us before it authenticated:
/// enough for a `Handshake`, far too little to pin memory with. Raised to
/// [`AUTHENTICATED_RECEIVE_WINDOW`] once the peer proved the secret.
pub const UNAUTHENTICATED_RECEIVE_WINDOW: u32 = 128 << 10;
/// Connection-level receive window of an authenticated peer: a full-size
/// frame plus room to keep the link busy.
pub const AUTHENTICATED_RECEIVE_WINDOW: u32 = 16 << 20;

/// QUIC's own liveness: keep-alives every second, and a peer silent for
/// this long is closed. The coordinator's stats watchdog is faster; this is
/// the backstop that needs no application task to run.
pub const IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The congestion controller of a link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Congestion {
    Cubic,
    NewReno,
    Bbr,
}

/// How the QUIC links are tuned for the networks they run on: home and
/// office LANs and Wi-Fi (1 to 20 ms, jitter, some loss). [`Tuning::LAN`]
/// is what every link uses; the others exist for `tinyvllm-linkbench`,
/// which measured the choice (docs/networks.md): a loss-based controller
/// (CUBIC, NewReno) reads Wi-Fi's random loss as congestion and carries a
/// prefill chunk's activations 7 to 76 times slower than BBR at 0.1 to 2%
/// loss; and an initial RTT of a LAN's order, not quinn's Internet-sized
/// 333 ms, lets the first losses be detected in time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    pub congestion: Congestion,
    /// The round trip assumed before one is measured: it sets the first
    /// loss-detection timeouts (quinn's default, 333 ms, is an Internet path's).
    pub initial_rtt: std::time::Duration,
}

impl Tuning {
    pub const LAN: Self = Self { congestion: Congestion::Bbr, initial_rtt: std::time::Duration::from_millis(10) };
}

/// `peer_bidi_streams`: how many bidirectional streams the other side may
/// open (the worker opens the one control stream; the coordinator opens none).
fn quic_transport(peer_bidi_streams: u32, tuning: Tuning) -> Arc<quinn::TransportConfig> {
    let mut transport = quinn::TransportConfig::default();
    transport.initial_rtt(tuning.initial_rtt);
    match tuning.congestion {
        Congestion::Cubic => {
            transport.congestion_controller_factory(Arc::new(quinn::congestion::CubicConfig::default()))
        }
        Congestion::NewReno => {
            transport.congestion_controller_factory(Arc::new(quinn::congestion::NewRenoConfig::default()))
        }
        Congestion::Bbr => transport.congestion_controller_factory(Arc::new(quinn::congestion::BbrConfig::default())),
    };
    transport.keep_alive_interval(Some(std::time::Duration::from_secs(1)));
    transport.max_idle_timeout(Some(
        quinn::IdleTimeout::try_from(IDLE_TIMEOUT).expect("a 10 s idle timeout is representable"),
    ));
    // The protocol is one bidirectional stream; a peer may open no more, so
    // it cannot make us buffer data on streams nobody reads.
    transport.max_concurrent_bidi_streams(peer_bidi_streams.into());
    transport.max_concurrent_uni_streams(0u32.into());
    transport.stream_receive_window(((MAX_FRAME_BYTES as u32) + (1 << 20)).into());
    transport.receive_window(UNAUTHENTICATED_RECEIVE_WINDOW.into());
    Arc::new(transport)
}

/// The reason a worker closes its connection with once it drained: the
/// coordinator logs the departure as such, not as a lost worker.
pub const DRAINED_CLOSE_REASON: &[u8] = b"drained";

/// Lifts the receive window of a connection whose peer authenticated.
pub fn trust_connection(conn: &quinn::Connection) {
    conn.set_receive_window(AUTHENTICATED_RECEIVE_WINDOW.into());
}

pub fn server_config(
    cert: rustls::pki_types::CertificateDer<'static>,
    key: rustls::pki_types::PrivateKeyDer<'static>,
) -> Result<quinn::ServerConfig, TransportError> {
    server_config_tuned(cert, key, Tuning::LAN)
}

/// As [`server_config`], tuned otherwise (for the link benchmark).
pub fn server_config_tuned(
    cert: rustls::pki_types::CertificateDer<'static>,
    key: rustls::pki_types::PrivateKeyDer<'static>,
    tuning: Tuning,
) -> Result<quinn::ServerConfig, TransportError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| TransportError::Tls(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)
        .map_err(|e| TransportError::Tls(e.to_string()))?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto =
        quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(|e| TransportError::Tls(e.to_string()))?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(quic_transport(1, tuning));
    Ok(config)
}

pub fn client_config() -> Result<quinn::ClientConfig, TransportError> {
    client_config_tuned(Tuning::LAN)
}

/// As [`client_config`], tuned otherwise (for the link benchmark).
pub fn client_config_tuned(tuning: Tuning) -> Result<quinn::ClientConfig, TransportError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| TransportError::Tls(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(ChannelBoundVerifier(provider)))
        .with_no_client_auth();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto =
        quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| TransportError::Tls(e.to_string()))?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(quic_transport(0, tuning));
    Ok(config)
}

/// A client endpoint for dialling `peer`: a socket of its address family
/// on any port, with [`client_config`].
pub fn client_endpoint(peer: std::net::SocketAddr) -> Result<quinn::Endpoint, TransportError> {
    let any: std::net::SocketAddr = if peer.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" }.parse().expect("literal");
    let mut endpoint = quinn::Endpoint::client(any)?;
    endpoint.set_default_client_config(client_config()?);
    Ok(endpoint)
}

/// Accepts the coordinator's self-signed certificate but checks the TLS
/// handshake signatures; identity comes from the channel-bound HMAC.
#[derive(Debug)]
struct ChannelBoundVerifier(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for ChannelBoundVerifier {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Who computes a tag: the two roles get different tags so a reflected
/// worker tag is useless as the coordinator's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Worker,
    Coordinator,
}

/// 32 bytes of keying material unique to this TLS session.
pub fn channel_binding(conn: &quinn::Connection) -> Result<[u8; 32], TransportError> {
    let mut out = [0u8; 32];
    conn.export_keying_material(&mut out, b"EXPORTER-tinyvllm-cluster-auth", b"")
        .map_err(|_| TransportError::Tls("cannot export keying material".into()))?;
    Ok(out)
}

/// HMAC-SHA256(secret, role || binding).
pub fn auth_tag(secret: &[u8], role: Role, binding: &[u8; 32]) -> Vec<u8> {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    let mut ctx = ring::hmac::Context::with_key(&key);
    ctx.update(role_label(role));
    ctx.update(binding);
    ctx.sign().as_ref().to_vec()
}

/// Constant-time check of a peer's tag.
pub fn verify_auth_tag(secret: &[u8], role: Role, binding: &[u8; 32], tag: &[u8]) -> bool {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    let mut message = role_label(role).to_vec();
    message.extend_from_slice(binding);
    ring::hmac::verify(&key, &message, tag).is_ok()
}

fn role_label(role: Role) -> &'static [u8] {
    match role {
        Role::Worker => b"tinyvllm worker\0",
        Role::Coordinator => b"tinyvllm coordinator\0",
    }
}

/// Resolves on SIGTERM or Ctrl-C: both binaries drain on either.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        // If the handler cannot be installed, Ctrl-C still works.
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

/// A fresh random secret, hex-encoded (for `--cluster-secret-file` when none exists).
pub fn generate_secret() -> String {
    let mut bytes = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes).expect("OS random source");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A secret shorter than this is refused: it could be guessed offline from
/// one recorded handshake.
pub const MIN_SECRET_BYTES: usize = 16;
/// A secret shorter than this is accepted with a warning (`generate_secret`
/// writes 64 hex characters).
pub const RECOMMENDED_SECRET_BYTES: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum SecretFileError {
    #[error("reading the cluster secret from {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error(
        "the cluster secret in {path} is {len} bytes; at least {MIN_SECRET_BYTES} are required \
         ({RECOMMENDED_SECRET_BYTES} or more recommended, e.g. `openssl rand -hex 32 > {path}`)"
    )]
    TooShort { path: String, len: usize },
}

/// A cluster secret read from its file, and what is wrong with the file
/// short of refusing it (for the caller to log).
#[derive(Debug)]
pub struct SecretFile {
    pub secret: String,
    pub warnings: Vec<String>,
}

/// Reads a cluster secret (surrounding whitespace trimmed). Under
/// [`MIN_SECRET_BYTES`] it is refused; under [`RECOMMENDED_SECRET_BYTES`],
/// or in a file that group or others may read, it is accepted with a warning.
pub fn read_secret_file(path: &std::path::Path) -> Result<SecretFile, SecretFileError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| SecretFileError::Read { path: shown.clone(), source })?;
    let secret = text.trim().to_string();
    if secret.len() < MIN_SECRET_BYTES {
        return Err(SecretFileError::TooShort { path: shown, len: secret.len() });
    }
    let mut warnings = Vec::new();
    if secret.len() < RECOMMENDED_SECRET_BYTES {
        warnings.push(format!(
            "the cluster secret in {shown} is only {} bytes; {RECOMMENDED_SECRET_BYTES} or more are recommended",
            secret.len()
        ));
    }
    #[cfg(unix)]
    if let Ok(meta) = std::fs::metadata(path) {
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            warnings.push(format!(
                "{shown} (mode {mode:04o}) is readable by other users; `chmod 600 {shown}` keeps the cluster secret \
                 to its owner"
            ));
        }
    }
    Ok(SecretFile { secret, warnings })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_depend_on_secret_role_and_binding() {
        let binding = [7u8; 32];
        let tag = auth_tag(b"s3cret", Role::Worker, &binding);
        assert!(verify_auth_tag(b"s3cret", Role::Worker, &binding, &tag));
        assert!(!verify_auth_tag(b"other", Role::Worker, &binding, &tag));
        assert!(!verify_auth_tag(b"s3cret", Role::Coordinator, &binding, &tag));
        assert!(!verify_auth_tag(b"s3cret", Role::Worker, &[8u8; 32], &tag));
        assert_eq!(generate_secret().len(), 64);
    }

    fn secret_file(tag: &str, contents: &str, mode: u32) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!("tinyvllm-secret-{tag}-{}", std::process::id()));
        std::fs::write(&path, contents).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        #[cfg(not(unix))]
        let _ = mode;
        path
    }

    #[test]
    fn short_secrets_are_refused_and_weak_files_warned_about() {
        let path = secret_file("short", "x\n", 0o600);
        let err = read_secret_file(&path).unwrap_err().to_string();
        assert!(err.contains("is 1 bytes; at least 16 are required"), "{err}");
        let path = secret_file("fifteen", &"a".repeat(15), 0o600);
        assert!(matches!(read_secret_file(&path), Err(SecretFileError::TooShort { len: 15, .. })));
        // 16..32 bytes: accepted with a warning.
        let path = secret_file("sixteen", &format!("  {}\n", "b".repeat(16)), 0o600);
        let read = read_secret_file(&path).unwrap();
        assert_eq!(read.secret, "b".repeat(16));
        assert_eq!(read.warnings.len(), 1, "{:?}", read.warnings);
        assert!(read.warnings[0].contains("only 16 bytes"), "{:?}", read.warnings);
        // A good secret in a private file: no warning.
        let path = secret_file("good", &generate_secret(), 0o600);
        assert!(read_secret_file(&path).unwrap().warnings.is_empty());
        #[cfg(unix)]
        {
            // Readable by the group or by everyone: warned about.
            for mode in [0o644, 0o640, 0o604] {
                let path = secret_file(&format!("mode{mode:o}"), &generate_secret(), mode);
                let read = read_secret_file(&path).unwrap();
                assert_eq!(read.warnings.len(), 1, "{mode:o}");
                assert!(read.warnings[0].contains("readable by other users"), "{:?}", read.warnings);
            }
        }
        let missing = std::env::temp_dir().join("tinyvllm-secret-does-not-exist");
        assert!(matches!(read_secret_file(&missing), Err(SecretFileError::Read { .. })));
    }

    #[tokio::test]
    async fn frames_cross_a_real_quic_connection_and_bindings_agree() {
        let (cert, key) = self_signed_cert().unwrap();
        let server =
            quinn::Endpoint::server(server_config(cert, key).unwrap(), "127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = server.local_addr().unwrap();
        let server_task = tokio::spawn(async move {
            let conn = server.accept().await.unwrap().await.unwrap();
            let (mut send, mut recv) = conn.accept_bi().await.unwrap();
            let msg: crate::protocol::CoordinatorMessage = read_frame(&mut recv).await.unwrap().unwrap();
            write_frame(&mut send, &msg).await.unwrap();
            send.finish().unwrap();
            let binding = channel_binding(&conn).unwrap();
            conn.closed().await;
            binding
        });
        let mut client = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        client.set_default_client_config(client_config().unwrap());
        let conn = client.connect(addr, SERVER_NAME).unwrap().await.unwrap();
        let (mut send, mut recv) = conn.open_bi().await.unwrap();
        let msg = crate::protocol::CoordinatorMessage::Abort { request_id: crate::RequestId(3) };
        write_frame(&mut send, &msg).await.unwrap();
        let echoed: crate::protocol::CoordinatorMessage = read_frame(&mut recv).await.unwrap().unwrap();
        assert_eq!(echoed, msg);
        assert!(read_frame::<crate::protocol::CoordinatorMessage>(&mut recv).await.unwrap().is_none());
        let binding = channel_binding(&conn).unwrap();
        conn.close(0u32.into(), b"done");
        assert_eq!(server_task.await.unwrap(), binding);
    }
}
