//! `cargo xtask npm`: vLLM's block keys for JavaScript. Builds `kvaffine-keys` (core/js)
//! with wasm-bindgen twice, for Node (a synchronous `require()`) and for browsers (an ES
//! module), packs both into `target/npm/kvaffine-keys-<version>.tgz`, and refreshes the
//! console's copy of the browser build (`daemon/ui/keys/`), which is committed so that a
//! plain `cargo build -p kvaffined` needs no wasm tooling. `cargo xtask test` checks that
//! copy is current and runs the package's tests under Node against `../shared/vectors`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use crate::sh;

/// wasm-bindgen's CLI must be the very version of the crate (`core/js/Cargo.toml` pins it).
const WASM_BINDGEN_VERSION: &str = "0.2.130";
const TARGET: &str = "wasm32-unknown-unknown";
const PACKAGE: &str = "kvaffine-keys";
/// The files of the browser build that the console serves.
const CONSOLE_FILES: [&str; 2] = ["kvaffine_keys.js", "kvaffine_keys_bg.wasm"];

fn console_dir() -> PathBuf {
    sh::root().join("daemon/ui/keys")
}

fn version() -> anyhow::Result<String> {
    let manifest = std::fs::read_to_string(sh::root().join("core/js/Cargo.toml"))?;
    manifest
        .lines()
        .find_map(|line| line.strip_prefix("version = \""))
        .and_then(|rest| rest.strip_suffix('"'))
        .map(str::to_owned)
        .context("core/js/Cargo.toml has no version")
}

/// Installs wasm-bindgen's CLI at the crate's version unless it is on PATH already.
fn ensure_wasm_bindgen() -> anyhow::Result<()> {
    let installed = Command::new("wasm-bindgen")
        .arg("--version")
        .output()
        .ok()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned());
    if installed.as_deref() == Some(&format!("wasm-bindgen {WASM_BINDGEN_VERSION}")) {
        return Ok(());
    }
    // Not `--locked`: the CLI's own lock file names a crate version the registry has
    // since withdrawn.
    sh::cargo(&[
        "install",
        "wasm-bindgen-cli",
        "--version",
        WASM_BINDGEN_VERSION,
    ])
}

/// Builds the package's files into `out` (`node/`, `web/`, `package.json`, `README.md`).
fn build(out: &Path) -> anyhow::Result<()> {
    sh::ensure_target(TARGET)?;
    ensure_wasm_bindgen()?;
    let root = sh::root();
    // The module is committed (the console's copy): no machine's paths go into it.
    let cargo_home = std::env::var("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|_| std::env::var("HOME").map(|home| PathBuf::from(home).join(".cargo")))
        .context("neither CARGO_HOME nor HOME is set")?;
    let remap = format!(
        "--remap-path-prefix={}=cargo --remap-path-prefix={}=kvaffine",
        cargo_home.display(),
        root.display()
    );
    sh::run(
        Command::new(sh::cargo_bin())
            .args([
                "build",
                "-p",
                PACKAGE,
                "--target",
                TARGET,
                "--profile",
                "wasm-js",
            ])
            .env("CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUSTFLAGS", remap),
    )?;
    let module = root.join(format!("target/{TARGET}/wasm-js/kvaffine_keys.wasm"));
    if out.exists() {
        std::fs::remove_dir_all(out)?;
    }
    for (target, dir) in [("nodejs", "node"), ("web", "web")] {
        sh::run(
            Command::new("wasm-bindgen")
                .args(["--target", target, "--out-dir"])
                .arg(out.join(dir))
                .arg(&module),
        )?;
    }
    let version = version()?;
    let manifest = serde_json::json!({
        "name": PACKAGE,
        "version": version,
        "description": "vLLM's prefix-cache block keys (sha256_cbor, xxhash_cbor), byte for byte, from kvaffine-core built with wasm-bindgen",
        "license": "Apache-2.0",
        "main": "./node/kvaffine_keys.js",
        "types": "./node/kvaffine_keys.d.ts",
        "browser": "./web/kvaffine_keys.js",
        "exports": {
            ".": {
                "types": "./node/kvaffine_keys.d.ts",
                "browser": "./web/kvaffine_keys.js",
                "node": "./node/kvaffine_keys.js",
                "default": "./web/kvaffine_keys.js"
            },
            "./web": {
                "types": "./web/kvaffine_keys.d.ts",
                "default": "./web/kvaffine_keys.js"
            },
            "./web/kvaffine_keys_bg.wasm": "./web/kvaffine_keys_bg.wasm"
        },
        "files": ["node/", "web/", "README.md"],
        "engines": { "node": ">=18" },
        "sideEffects": false
    });
    std::fs::write(
        out.join("package.json"),
        serde_json::to_string_pretty(&manifest)? + "\n",
    )?;
    std::fs::copy(root.join("core/js/README.md"), out.join("README.md"))?;
    Ok(())
}

/// `cargo xtask npm`: the tarball, and the console's copy of the browser build.
pub fn run() -> anyhow::Result<()> {
    let tarball = pack()?;
    let web = staging().join("web");
    std::fs::create_dir_all(console_dir())?;
    for file in CONSOLE_FILES {
        std::fs::copy(web.join(file), console_dir().join(file))?;
    }
    eprintln!("xtask npm: {}", tarball.display());
    Ok(())
}

fn staging() -> PathBuf {
    sh::root().join("target/npm/package")
}

/// Builds and packs the package; the tarball's path.
fn pack() -> anyhow::Result<PathBuf> {
    let staging = staging();
    build(&staging)?;
    let out = sh::root().join("target/npm");
    sh::run(
        Command::new("npm")
            .args(["pack", "--quiet"])
            .arg(&staging)
            .arg("--pack-destination")
            .arg(&out),
    )?;
    let tarball = out.join(format!("{PACKAGE}-{}.tgz", version()?));
    if !tarball.is_file() {
        bail!("npm pack wrote no {}", tarball.display());
    }
    Ok(tarball)
}

/// For `cargo xtask test`: packs, fails unless the console's committed copy is what the
/// sources build, and runs the package's Node tests; their passed and failed counts.
pub fn test() -> anyhow::Result<(u64, u64)> {
    let tarball = pack()?;
    let web = staging().join("web");
    for file in CONSOLE_FILES {
        let built = std::fs::read(web.join(file))?;
        let committed = std::fs::read(console_dir().join(file)).unwrap_or_default();
        if built != committed {
            bail!(
                "daemon/ui/keys/{file} is not what core/js builds: run `cargo xtask npm` and commit it"
            );
        }
    }
    // Installed as a user installs it: the tarball unpacked under node_modules.
    let project = sh::root().join("target/npm/test");
    if project.exists() {
        std::fs::remove_dir_all(&project)?;
    }
    let modules = project.join("node_modules").join(PACKAGE);
    std::fs::create_dir_all(&modules)?;
    sh::run(
        Command::new("tar")
            .args(["-xzf"])
            .arg(&tarball)
            .args(["--strip-components=1", "-C"])
            .arg(&modules),
    )?;
    let test_file = project.join("keys.test.mjs");
    std::fs::copy(sh::root().join("core/js/test/keys.test.mjs"), &test_file)?;
    let vectors = sh::root().join("../shared/vectors/block_hashes.json");
    // TAP whatever Node's default reporter is: its `# pass` and `# fail` lines are counted.
    let output = Command::new("node")
        .args(["--test", "--test-reporter=tap"])
        .arg(&test_file)
        .env("KVAFFINE_VECTORS", &vectors)
        .current_dir(&project)
        .output()
        .context("node (>= 18) is needed for the kvaffine-keys tests")?;
    let text = String::from_utf8_lossy(&output.stdout);
    print!("{text}");
    eprint!("{}", String::from_utf8_lossy(&output.stderr));
    let count = |label: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(label))
            .and_then(|n| n.trim().parse::<u64>().ok())
    };
    let (Some(passed), Some(failed)) = (count("# pass "), count("# fail ")) else {
        bail!("node --test printed no pass/fail counts");
    };
    if !output.status.success() || failed > 0 {
        bail!("the kvaffine-keys Node tests failed ({failed} failed)");
    }
    Ok((passed, failed))
}
