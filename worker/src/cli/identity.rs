//! A worker's stable identity: a random id kept in its state directory
//! (`--state-dir`), so a worker keeps its id and default name across
//! restarts, beside the fingerprint of the machine that made it. A state
//! directory copied to another machine (a cloned disk, a copied home) is
//! noticed by that fingerprint and given a new id, so two machines never
//! join as one worker; the coordinator refuses a second live worker with an
//! id it already has.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Stored {
    id: String,
    machine: String,
}

/// The id, and the machine the state directory came from when it was copied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub id: String,
    pub copied_from: Option<String>,
}

/// The state directory by default: `$XDG_STATE_HOME/tinyvllm`, else
/// `~/.local/state/tinyvllm`, else the temporary directory's.
pub fn default_state_dir() -> PathBuf {
    std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".local/state")))
        .unwrap_or_else(std::env::temp_dir)
        .join("tinyvllm")
}

/// The identity of the worker `key` (its `--name`, or "default") in
/// `state_dir`, created on first use and renewed if the directory was
/// copied from another machine.
pub fn load_or_create(state_dir: &Path, key: &str) -> std::io::Result<Identity> {
    load_or_create_on(state_dir, key, &machine_fingerprint())
}

fn load_or_create_on(state_dir: &Path, key: &str, machine: &str) -> std::io::Result<Identity> {
    let safe: String =
        key.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect();
    let path = state_dir.join(format!("worker-{safe}.json"));
    let stored = std::fs::read_to_string(&path).ok().and_then(|text| serde_json::from_str::<Stored>(&text).ok());
    match stored {
        Some(stored) if stored.machine == machine => Ok(Identity { id: stored.id, copied_from: None }),
        Some(stored) => {
            let identity = Identity { id: new_id(), copied_from: Some(stored.machine) };
            write(&path, &Stored { id: identity.id.clone(), machine: machine.to_string() })?;
            Ok(identity)
        }
        None => {
            let identity = Identity { id: new_id(), copied_from: None };
            write(&path, &Stored { id: identity.id.clone(), machine: machine.to_string() })?;
            Ok(identity)
        }
    }
}

fn write(path: &Path, stored: &Stored) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let staging =
        dir.join(format!(".{}.{}", std::process::id(), path.file_name().and_then(|n| n.to_str()).unwrap_or("id")));
    std::fs::write(&staging, serde_json::to_string(stored).map_err(std::io::Error::other)?)?;
    std::fs::rename(staging, path)
}

fn new_id() -> String {
    common::transport::generate_secret()[..16].to_string()
}

/// What tells this machine from another: its OS's machine id, else its
/// host name.
fn machine_fingerprint() -> String {
    for file in ["/etc/machine-id", "/var/lib/dbus/machine-id"] {
        if let Ok(id) = std::fs::read_to_string(file).map(|s| s.trim().to_string())
            && !id.is_empty()
        {
            return id;
        }
    }
    #[cfg(target_os = "macos")]
    if let Ok(out) = std::process::Command::new("ioreg").args(["-rd1", "-c", "IOPlatformExpertDevice"]).output() {
        let text = String::from_utf8_lossy(&out.stdout);
        if let Some(uuid) = text.lines().find(|l| l.contains("IOPlatformUUID")).and_then(|l| l.split('"').nth(3)) {
            return uuid.to_string();
        }
    }
    std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "unknown".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_last_and_a_copied_directory_is_noticed() {
        let dir = std::env::temp_dir().join(format!("tinyvllm-identity-{}", std::process::id()));
        let first = load_or_create_on(&dir, "mini", "machine-a").unwrap();
        assert_eq!(first.copied_from, None);
        assert_eq!(first.id.len(), 16);
        assert_eq!(load_or_create_on(&dir, "mini", "machine-a").unwrap(), first, "kept across restarts");
        assert_ne!(load_or_create_on(&dir, "air", "machine-a").unwrap().id, first.id, "one id per worker name");
        // The same directory on another machine: a new id, and where it came from.
        let copied = load_or_create_on(&dir, "mini", "machine-b").unwrap();
        assert_ne!(copied.id, first.id);
        assert_eq!(copied.copied_from.as_deref(), Some("machine-a"));
        assert_eq!(load_or_create_on(&dir, "mini", "machine-b").unwrap().copied_from, None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
