//! Join tokens: what a worker needs to join a cluster, in one string a
//! user pastes (`tinyvllm-coordinator join-token` prints one,
//! `tinyvllm-worker serve --join TOKEN` takes it). A token carries the
//! cluster secret and, for networks without multicast discovery, the
//! coordinator's QUIC address.
//!
//! Layout: `tvj1_` then base64url (no padding) of a form byte (1: the
//! secret as text; 2: a lowercase-hex secret, as the coordinator writes
//! them, as its bytes, which halves the token), the secret's length (one
//! byte) and bytes, the address's bytes (maybe none), and the first four
//! bytes of the SHA-256 of all that, so a token cut short or mistyped is
//! refused by name rather than turned into a wrong secret.
//!
//! A token grants exactly what the secret does: keep it as private as the
//! secret file. Discovery never grants trust; the secret still decides.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

const PREFIX: &str = "tvj1_";
const TEXT_SECRET: u8 = 1;
const HEX_SECRET: u8 = 2;
const CHECK_BYTES: usize = 4;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JoinToken {
    pub secret: String,
    /// The coordinator's QUIC address, HOST:PORT, if the token names it.
    pub coordinator: Option<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum JoinTokenError {
    #[error("not a join token (they start with {PREFIX}; print one with `tinyvllm-coordinator join-token`)")]
    Prefix,
    #[error("the join token is damaged ({0}): copy it again, whole")]
    Damaged(&'static str),
    #[error("the cluster secret is too long for a join token (at most 255 bytes)")]
    SecretTooLong,
}

impl JoinToken {
    pub fn encode(&self) -> Result<String, JoinTokenError> {
        let (form, secret) = match hex_bytes(&self.secret) {
            Some(bytes) => (HEX_SECRET, bytes),
            None => (TEXT_SECRET, self.secret.as_bytes().to_vec()),
        };
        let len = u8::try_from(secret.len()).map_err(|_| JoinTokenError::SecretTooLong)?;
        let mut bytes = vec![form, len];
        bytes.extend_from_slice(&secret);
        bytes.extend_from_slice(self.coordinator.as_deref().unwrap_or_default().as_bytes());
        let check = checksum(&bytes);
        bytes.extend_from_slice(&check);
        Ok(format!("{PREFIX}{}", URL_SAFE_NO_PAD.encode(bytes)))
    }

    pub fn decode(token: &str) -> Result<Self, JoinTokenError> {
        let body = token.trim().strip_prefix(PREFIX).ok_or(JoinTokenError::Prefix)?;
        let bytes = URL_SAFE_NO_PAD.decode(body).map_err(|_| JoinTokenError::Damaged("not base64url"))?;
        if bytes.len() < 2 + CHECK_BYTES {
            return Err(JoinTokenError::Damaged("too short"));
        }
        let (content, check) = bytes.split_at(bytes.len() - CHECK_BYTES);
        if checksum(content) != check {
            return Err(JoinTokenError::Damaged("its checksum does not match"));
        }
        let len = usize::from(content[1]);
        let rest = &content[2..];
        if rest.len() < len {
            return Err(JoinTokenError::Damaged("too short"));
        }
        let secret = match content[0] {
            TEXT_SECRET => {
                std::str::from_utf8(&rest[..len]).map_err(|_| JoinTokenError::Damaged("not text"))?.to_string()
            }
            HEX_SECRET => rest[..len].iter().map(|b| format!("{b:02x}")).collect(),
            _ => return Err(JoinTokenError::Damaged("an unknown form")),
        };
        let address = std::str::from_utf8(&rest[len..]).map_err(|_| JoinTokenError::Damaged("not text"))?;
        Ok(Self { secret, coordinator: (!address.is_empty()).then(|| address.to_string()) })
    }
}

/// The bytes of a lowercase-hex string of even length (what
/// `generate_secret` writes), which encode back to the same text.
fn hex_bytes(text: &str) -> Option<Vec<u8>> {
    if text.is_empty()
        || !text.len().is_multiple_of(2)
        || !text.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok()).collect()
}

fn checksum(bytes: &[u8]) -> [u8; CHECK_BYTES] {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0u8; CHECK_BYTES];
    out.copy_from_slice(&digest.as_ref()[..CHECK_BYTES]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_damage_is_named() {
        let token = JoinToken { secret: "ab".repeat(32), coordinator: Some("mac-mini.local:7070".into()) };
        let text = token.encode().unwrap();
        assert!(text.starts_with("tvj1_") && text.len() < 90, "{text}");
        assert_eq!(JoinToken::decode(&text), Ok(token.clone()));
        assert_eq!(JoinToken::decode(&format!("  {text}\n")), Ok(token));
        let bare = JoinToken { secret: "s".repeat(20), coordinator: None };
        assert_eq!(JoinToken::decode(&bare.encode().unwrap()), Ok(bare));
        // Hex that would not read back the same (upper case, odd length) stays text.
        for secret in ["AB".repeat(16), "abc".repeat(7)] {
            let token = JoinToken { secret, coordinator: None };
            assert_eq!(JoinToken::decode(&token.encode().unwrap()), Ok(token));
        }
        // Every single-character change or cut is refused, never a wrong secret.
        for i in 5..text.len() {
            let mut changed = text.clone().into_bytes();
            changed[i] = if changed[i] == b'A' { b'B' } else { b'A' };
            let changed = String::from_utf8(changed).unwrap();
            assert!(JoinToken::decode(&changed).is_err(), "changed at {i}");
            assert!(JoinToken::decode(&text[..i]).is_err(), "cut at {i}");
        }
        assert_eq!(JoinToken::decode("hello"), Err(JoinTokenError::Prefix));
        let long = JoinToken { secret: "x".repeat(300), coordinator: None };
        assert_eq!(long.encode(), Err(JoinTokenError::SecretTooLong));
    }
}
