//! The service files agree with the steps that install and feed them: the
//! launchd plists run the binaries where `tools/install.sh` puts them, read
//! the secret file the macOS steps write, and pass only flags the binaries
//! take (the same for the systemd units). Plists are parsed as the plain
//! XML they are (`plutil` is macOS-only).

use std::path::Path;
use std::process::Command;

use tinyvllm_tests::{binary, repo_root};

/// The macOS secret file, as the docs write it and as the plists must
/// (launchd expands no `~`).
const MAC_SECRET: &str = "~/tinyvllm-cluster-secret";

fn read(path: &str) -> String {
    std::fs::read_to_string(repo_root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The `<string>`s of the plist's `ProgramArguments` array.
fn program_arguments(plist: &str) -> Vec<String> {
    let after = plist.split("<key>ProgramArguments</key>").nth(1).expect("a ProgramArguments key");
    let array = after.trim_start().strip_prefix("<array>").expect("an <array> after ProgramArguments");
    let array = &array[..array.find("</array>").expect("</array>")];
    array.split("<string>").skip(1).map(|s| s[..s.find("</string>").expect("</string>")].trim().to_string()).collect()
}

/// The value after each `flag` in a command line's words.
fn values_after<'a>(words: &[&'a str], flag: &str) -> Vec<&'a str> {
    words.windows(2).filter(|w| w[0] == flag).map(|w| w[1]).collect()
}

/// Where `tools/install.sh` installs by default.
fn install_dir() -> String {
    let script = read("tools/install.sh");
    let line = script.lines().find(|l| l.starts_with("BIN_DIR=")).expect("a BIN_DIR= line");
    let default = line.split(":-").nth(1).and_then(|s| s.split('}').next()).expect("BIN_DIR=${BIN_DIR:-...}");
    default.to_string()
}

/// The long flags `--help` lists.
fn help_flags(bin: &str, args: &[&str]) -> Vec<String> {
    let out = Command::new(binary(bin)).args(args).arg("--help").output().expect("running --help");
    assert!(out.status.success(), "{bin} {args:?} --help: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == '=')
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| w.trim_end_matches(|c: char| !c.is_ascii_alphanumeric()).to_string())
        .collect()
}

fn check_flags(file: &str, words: &[&str], known: &[String]) {
    for w in words.iter().filter(|w| w.starts_with("--")) {
        assert!(known.iter().any(|k| k == w), "{file} passes {w}, which --help does not list ({known:?})");
    }
}

#[test]
fn launchd_plists_match_the_install_step_the_docs_and_the_binaries() {
    let bin_dir = install_dir();
    let plists = [
        ("deploy/launchd/com.tinyvllm.coordinator.plist", "tinyvllm-coordinator", &[][..]),
        ("deploy/launchd/com.tinyvllm.worker.plist", "tinyvllm-worker", &["serve"][..]),
    ];
    for (file, bin, sub) in plists {
        let args = program_arguments(&read(file));
        let words: Vec<&str> = args.iter().map(String::as_str).collect();
        assert_eq!(words[0], Path::new(&bin_dir).join(bin).to_str().unwrap(), "{file}: not where install.sh puts it");
        assert_eq!(&words[1..=sub.len()], sub, "{file}");
        let secret = values_after(&words, "--cluster-secret-file");
        assert_eq!(secret, [MAC_SECRET.replace('~', "/Users/YOU")], "{file}: not the docs' secret file");
        check_flags(file, &words[1 + sub.len()..], &help_flags(bin, sub));
    }
}

/// Every command in the macOS steps and the README's cluster section names
/// the same secret file as the plists; both docs run the install step.
#[test]
fn the_docs_name_one_secret_file_and_the_install_step() {
    for doc in ["deploy/RUN_ON_MACS.md", "README.md", "deploy/README.md"] {
        let text = read(doc);
        let words: Vec<&str> =
            text.split_whitespace().map(|w| w.trim_matches(|c: char| "`,.;:)".contains(c))).collect();
        // Paths only: flag tables show a placeholder, prose a "(default ...".
        for secret in values_after(&words, "--cluster-secret-file") {
            if secret.starts_with(['~', '/', '.']) {
                assert_eq!(secret, MAC_SECRET, "{doc}");
            }
        }
        assert!(text.contains("tools/install.sh"), "{doc} lacks the install step");
    }
    assert!(read("deploy/RUN_ON_MACS.md").contains(MAC_SECRET));
}

/// The systemd units run the installed binaries too, with one secret file
/// (the one deploy/README.md tells to copy), and flags the binaries take.
#[test]
fn systemd_units_match_the_install_step_and_the_binaries() {
    let bin_dir = install_dir();
    let deploy_readme = read("deploy/README.md");
    let units = [
        ("deploy/systemd/tinyvllm-coordinator.service", "tinyvllm-coordinator", &[][..]),
        ("deploy/systemd/tinyvllm-worker@.service", "tinyvllm-worker", &["serve"][..]),
    ];
    for (file, bin, sub) in units {
        let unit = read(file);
        let exec = unit.lines().find_map(|l| l.strip_prefix("ExecStart=")).expect("an ExecStart line");
        let words: Vec<&str> = exec.split_whitespace().collect();
        assert_eq!(words[0], Path::new(&bin_dir).join(bin).to_str().unwrap(), "{file}");
        for secret in values_after(&words, "--cluster-secret-file") {
            assert!(deploy_readme.contains(secret), "{file}: {secret} is not the one deploy/README.md names");
        }
        check_flags(file, &words[1 + sub.len()..], &help_flags(bin, sub));
    }
}
