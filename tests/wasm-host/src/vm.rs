//! One proxy-wasm VM on wasmtime: the ABI 0.2.1 host functions the kvaffine filter imports,
//! answering with the statuses Kong's ngx_wasm_module gives. Imports the host does not
//! implement (gRPC, shared data and queues) trap with their name, so a filter that starts
//! using one fails loudly here instead of being answered with something made up.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use wasmtime::{Caller, Engine, Extern, Instance, Linker, Memory, Module, Store, TypedFunc};

/// Proxy-wasm status codes (the subset this host returns).
mod status {
    pub const OK: i32 = 0;
    pub const NOT_FOUND: i32 = 1;
    pub const BAD_ARGUMENT: i32 = 2;
}

/// Buffer types of the ABI.
mod buffer {
    pub const REQUEST_BODY: i32 = 0;
    pub const RESPONSE_BODY: i32 = 1;
    pub const CALL_RESPONSE_BODY: i32 = 4;
    pub const VM_CONFIGURATION: i32 = 6;
    pub const PLUGIN_CONFIGURATION: i32 = 7;
}

/// Header map types of the ABI.
mod map {
    pub const REQUEST_HEADERS: i32 = 0;
    pub const RESPONSE_HEADERS: i32 = 2;
    pub const CALL_RESPONSE_HEADERS: i32 = 6;
}

/// Stream types of the ABI.
const STREAM_REQUEST: i32 = 0;

/// The root context id; streams count up from 2.
pub const ROOT_CONTEXT: u32 = 1;

/// Header pairs as the ABI passes them: names lower-case, values raw bytes.
pub type Headers = Vec<(String, Vec<u8>)>;

/// A metric the filter defined, with the name Kong gives it (`pw.<filter>.<name>`).
#[derive(Clone, Debug)]
pub struct Metric {
    /// Full name.
    pub name: String,
    /// Counter: 0; gauge: 1; histogram: 2 (the ABI's metric types).
    pub kind: i32,
    /// Counter total, gauge value, or the sum of recorded histogram values.
    pub value: i64,
    /// Histogram samples recorded (0 for counters and gauges).
    pub samples: u64,
}

/// An `proxy_http_call` the filter made, waiting for the host to carry it out.
#[derive(Clone, Debug)]
pub struct CallRequest {
    /// Token the filter will be called back with.
    pub token: u32,
    /// Stream that made the call.
    pub stream: u32,
    /// `host:port` (Kong resolves names; the callout target is never a cluster).
    pub upstream: String,
    /// Headers including `:method`, `:path` and `:authority`.
    pub headers: Headers,
    /// Request body.
    pub body: Vec<u8>,
    /// Timeout the filter asked for.
    pub timeout: Duration,
}

impl CallRequest {
    /// The call's `:path`.
    pub fn path(&self) -> String {
        self.headers
            .iter()
            .find(|(name, _)| name == ":path")
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_default()
    }
}

/// The outcome of a callout, as Kong reports it to the filter.
#[derive(Clone, Debug)]
pub enum CallOutcome {
    /// A response.
    Response {
        /// Headers, `:status` first.
        headers: Headers,
        /// Body.
        body: Vec<u8>,
    },
    /// No response: Kong gives no headers but `:dispatch_status` with the reason.
    Failed(&'static str),
}

/// A response the filter asked the host to send in place of forwarding.
#[derive(Clone, Debug)]
pub struct LocalResponse {
    /// HTTP status.
    pub status: u16,
    /// Headers to send.
    pub headers: Headers,
    /// Body to send.
    pub body: Vec<u8>,
}

/// What the host knows about one HTTP stream.
#[derive(Debug, Default)]
pub struct StreamState {
    /// Request headers, including `:method`, `:path`, `:authority`, `:scheme`.
    pub request_headers: Headers,
    /// The buffered body, or `None` when nginx spooled it to a file (larger than
    /// `client_body_buffer_size`): ngx_wasm_module cannot read such a body.
    pub request_body: Option<Vec<u8>>,
    /// Response headers, including `:status`, once the upstream answered.
    pub response_headers: Headers,
    /// The response body chunk being delivered.
    pub response_chunk: Vec<u8>,
    /// Properties the filter set (`kong.service.target`, ...), path joined with `.`.
    pub properties: HashMap<String, Vec<u8>>,
    /// The filter called `proxy_continue_stream` for the request.
    pub resumed: bool,
    /// The filter answered the request itself.
    pub local_response: Option<LocalResponse>,
    /// Callouts this stream made.
    pub calls_made: usize,
    /// Callouts of this stream still in flight.
    pub calls_in_flight: usize,
}

struct HostState {
    plugin_configuration: Vec<u8>,
    plugin_name: String,
    effective: u32,
    streams: HashMap<u32, StreamState>,
    call_response: Option<CallOutcome>,
    pending_calls: Vec<CallRequest>,
    next_token: u32,
    metrics: Vec<Metric>,
    logs: std::collections::VecDeque<String>,
    random: u64,
    random_source: RandomSource,
    tick_period_ms: u32,
}

/// What WASI `random_get` does in this host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RandomSource {
    /// Answers random bytes.
    Working,
    /// Fails every call with `EIO`, as a host without entropy would.
    Broken,
}

/// Log lines kept for tests and failures; older ones are dropped.
const LOG_LINES_KEPT: usize = 2_000;

impl HostState {
    fn stream(&mut self) -> Option<&mut StreamState> {
        self.streams.get_mut(&self.effective)
    }

    fn log(&mut self, line: String) {
        if self.logs.len() == LOG_LINES_KEPT {
            self.logs.pop_front();
        }
        self.logs.push_back(line);
    }
}

/// A loaded and configured filter.
pub struct Vm {
    store: Store<HostState>,
    exports: Exports,
    next_stream: u32,
    trapped: Option<String>,
}

struct Exports {
    context_create: TypedFunc<(i32, i32), ()>,
    request_headers: TypedFunc<(i32, i32, i32), i32>,
    request_body: TypedFunc<(i32, i32, i32), i32>,
    response_headers: TypedFunc<(i32, i32, i32), i32>,
    response_body: TypedFunc<(i32, i32, i32), i32>,
    tick: TypedFunc<i32, ()>,
    http_call_response: TypedFunc<(i32, i32, i32, i32, i32), ()>,
    log: TypedFunc<i32, ()>,
    done: TypedFunc<i32, i32>,
    delete: TypedFunc<i32, ()>,
}

/// What a filter callback returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Go on with the stream.
    Continue,
    /// Hold the stream until the filter resumes it.
    Pause,
}

impl Vm {
    /// Loads `wasm`, starts the VM and configures the plugin as Kong does (filter name =
    /// root id, configuration bytes passed raw). Fails if `on_configure` rejects them.
    pub fn load(wasm: &Path, plugin_name: &str, configuration: &[u8]) -> anyhow::Result<Self> {
        Self::load_with(wasm, plugin_name, configuration, RandomSource::Working)
    }

    /// [`Vm::load`] with WASI's random source as `random_source` says.
    pub fn load_with(
        wasm: &Path,
        plugin_name: &str,
        configuration: &[u8],
        random_source: RandomSource,
    ) -> anyhow::Result<Self> {
        let engine = Engine::default();
        let module = Module::from_file(&engine, wasm)
            .map_err(anyhow::Error::from)
            .with_context(|| format!("cannot load {}", wasm.display()))?;
        let mut linker = Linker::new(&engine);
        define_wasi(&mut linker)?;
        define_proxy_wasm(&mut linker)?;
        linker.define_unknown_imports_as_traps(&module)?;
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64 | 1);
        let state = HostState {
            plugin_configuration: configuration.to_vec(),
            plugin_name: plugin_name.to_owned(),
            effective: ROOT_CONTEXT,
            streams: HashMap::new(),
            call_response: None,
            pending_calls: Vec::new(),
            next_token: 1,
            metrics: Vec::new(),
            logs: std::collections::VecDeque::new(),
            random: seed,
            random_source,
            tick_period_ms: 0,
        };
        let mut store = Store::new(&engine, state);
        let instance = linker.instantiate(&mut store, &module)?;
        if let Ok(init) = instance.get_typed_func::<(), ()>(&mut store, "_initialize") {
            init.call(&mut store, ())?;
        }
        let exports = Exports::find(&instance, &mut store)?;
        let root = ROOT_CONTEXT as i32;
        exports.context_create.call(&mut store, (root, 0))?;
        let vm_start =
            instance.get_typed_func::<(i32, i32), i32>(&mut store, "proxy_on_vm_start")?;
        if vm_start.call(&mut store, (root, 0))? == 0 {
            bail!("the filter refused to start");
        }
        let configure =
            instance.get_typed_func::<(i32, i32), i32>(&mut store, "proxy_on_configure")?;
        let size = i32::try_from(configuration.len()).context("configuration too large")?;
        if configure.call(&mut store, (root, size))? == 0 {
            let logs: Vec<&str> = store.data().logs.iter().map(String::as_str).collect();
            let logs = logs.join("\n");
            bail!("the filter rejected its configuration:\n{logs}");
        }
        Ok(Self {
            store,
            exports,
            next_stream: ROOT_CONTEXT + 1,
            trapped: None,
        })
    }

    /// Why the VM is unusable, if it trapped. Kong fails the request of a trapped
    /// instance with a 500.
    pub fn trapped(&self) -> Option<&str> {
        self.trapped.as_deref()
    }

    fn guard<R>(&mut self, result: wasmtime::Result<R>) -> Option<R> {
        match result {
            Ok(value) => Some(value),
            Err(err) => {
                let message = format!("{err:?}");
                tracing::error!(%message, "the filter trapped");
                self.trapped.get_or_insert(message);
                None
            }
        }
    }

    /// Opens a stream for a request; `body` is `None` when it would not fit Kong's body
    /// buffer.
    pub fn open_stream(&mut self, headers: Headers, body: Option<Vec<u8>>) -> Option<u32> {
        let id = self.next_stream;
        self.next_stream += 1;
        self.store.data_mut().streams.insert(
            id,
            StreamState {
                request_headers: headers,
                request_body: body,
                ..StreamState::default()
            },
        );
        self.store.data_mut().effective = id;
        let result = self
            .exports
            .context_create
            .call(&mut self.store, (id as i32, ROOT_CONTEXT as i32));
        if self.guard(result).is_none() {
            self.store.data_mut().streams.remove(&id);
            return None;
        }
        Some(id)
    }

    fn action(&mut self, result: wasmtime::Result<i32>) -> Option<Action> {
        self.guard(result).map(|code| {
            if code == 0 {
                Action::Continue
            } else {
                Action::Pause
            }
        })
    }

    /// `on_request_headers`. Kong always passes `end_of_stream = false` here, even for a
    /// request without a body.
    pub fn on_request_headers(&mut self, stream: u32) -> Option<Action> {
        self.store.data_mut().effective = stream;
        let count = self.stream_state(stream)?.request_headers.len() as i32;
        let result = self
            .exports
            .request_headers
            .call(&mut self.store, (stream as i32, count, 0));
        self.action(result)
    }

    /// `on_request_body` once, with the whole buffered body and `end_of_stream = true`.
    pub fn on_request_body(&mut self, stream: u32, size: usize) -> Option<Action> {
        self.store.data_mut().effective = stream;
        let result = self
            .exports
            .request_body
            .call(&mut self.store, (stream as i32, size as i32, 1));
        self.action(result)
    }

    /// `on_response_headers` with the upstream's headers (`:status` first).
    pub fn on_response_headers(&mut self, stream: u32, headers: Headers) -> Option<Headers> {
        let state = self.store.data_mut();
        state.effective = stream;
        let count = headers.len() as i32;
        state.streams.get_mut(&stream)?.response_headers = headers;
        let result = self
            .exports
            .response_headers
            .call(&mut self.store, (stream as i32, count, 0));
        self.action(result)?;
        Some(std::mem::take(
            &mut self.stream_state_mut(stream)?.response_headers,
        ))
    }

    /// `on_response_body` with one chunk of the upstream's answer, as it passes.
    pub fn on_response_body(
        &mut self,
        stream: u32,
        chunk: &[u8],
        end_of_stream: bool,
    ) -> Option<Action> {
        let state = self.store.data_mut();
        state.effective = stream;
        state.streams.get_mut(&stream)?.response_chunk = chunk.to_vec();
        let result = self.exports.response_body.call(
            &mut self.store,
            (stream as i32, chunk.len() as i32, i32::from(end_of_stream)),
        );
        self.action(result)
    }

    /// The tick period the filter asked for (0: none).
    pub fn tick_period_ms(&self) -> u32 {
        self.store.data().tick_period_ms
    }

    /// One timer tick of the root context.
    pub fn tick(&mut self) {
        if self.trapped.is_some() {
            return;
        }
        self.store.data_mut().effective = ROOT_CONTEXT;
        let result = self.exports.tick.call(&mut self.store, ROOT_CONTEXT as i32);
        self.guard(result);
    }

    /// Answers `call` with `status` and `body`, as its upstream would.
    pub fn respond(&mut self, call: &CallRequest, status: &str, body: Vec<u8>) {
        self.on_http_call_response(
            call,
            CallOutcome::Response {
                headers: vec![(":status".into(), status.as_bytes().to_vec())],
                body,
            },
        );
    }

    /// Delivers a callout's outcome to the filter.
    pub fn on_http_call_response(&mut self, call: &CallRequest, outcome: CallOutcome) {
        // A stream that ended (its client went away) has its callouts cancelled, as hosts
        // cancel a deleted context's calls.
        let live =
            call.stream == ROOT_CONTEXT || self.store.data().streams.contains_key(&call.stream);
        if self.trapped.is_some() || !live {
            return;
        }
        let (headers, body) = match &outcome {
            CallOutcome::Response { headers, body } => (headers.len() as i32, body.len() as i32),
            CallOutcome::Failed(_) => (0, 0),
        };
        let state = self.store.data_mut();
        if let Some(stream) = state.streams.get_mut(&call.stream) {
            stream.calls_in_flight = stream.calls_in_flight.saturating_sub(1);
        }
        state.call_response = Some(outcome);
        state.effective = ROOT_CONTEXT;
        let result = self.exports.http_call_response.call(
            &mut self.store,
            (ROOT_CONTEXT as i32, call.token as i32, headers, body, 0),
        );
        self.store.data_mut().call_response = None;
        self.guard(result);
    }

    /// `on_log`, `on_done` and `on_delete`: the stream is over.
    pub fn close_stream(&mut self, stream: u32) {
        if self.trapped.is_some() {
            self.store.data_mut().streams.remove(&stream);
            return;
        }
        self.store.data_mut().effective = stream;
        let id = stream as i32;
        let result = self.exports.log.call(&mut self.store, id);
        if self.guard(result).is_some() {
            let result = self.exports.done.call(&mut self.store, id);
            if self.guard(result).is_some() {
                let result = self.exports.delete.call(&mut self.store, id);
                self.guard(result);
            }
        }
        self.store.data_mut().streams.remove(&stream);
    }

    /// The host's view of a stream.
    pub fn stream_state(&self, stream: u32) -> Option<&StreamState> {
        self.store.data().streams.get(&stream)
    }

    fn stream_state_mut(&mut self, stream: u32) -> Option<&mut StreamState> {
        self.store.data_mut().streams.get_mut(&stream)
    }

    /// Streams opened and not yet closed.
    pub fn open_streams(&self) -> usize {
        self.store.data().streams.len()
    }

    /// Callouts made since the last call, for the host to carry out.
    pub fn take_calls(&mut self) -> Vec<CallRequest> {
        std::mem::take(&mut self.store.data_mut().pending_calls)
    }

    /// The filter's metrics.
    pub fn metrics(&self) -> &[Metric] {
        &self.store.data().metrics
    }

    /// The filter's recent log lines.
    pub fn logs(&self) -> impl Iterator<Item = &str> {
        self.store.data().logs.iter().map(String::as_str)
    }
}

impl Exports {
    fn find(instance: &Instance, store: &mut Store<HostState>) -> anyhow::Result<Self> {
        Ok(Self {
            context_create: instance.get_typed_func(&mut *store, "proxy_on_context_create")?,
            request_headers: instance.get_typed_func(&mut *store, "proxy_on_request_headers")?,
            request_body: instance.get_typed_func(&mut *store, "proxy_on_request_body")?,
            response_headers: instance.get_typed_func(&mut *store, "proxy_on_response_headers")?,
            response_body: instance.get_typed_func(&mut *store, "proxy_on_response_body")?,
            tick: instance.get_typed_func(&mut *store, "proxy_on_tick")?,
            http_call_response: instance
                .get_typed_func(&mut *store, "proxy_on_http_call_response")?,
            log: instance.get_typed_func(&mut *store, "proxy_on_log")?,
            done: instance.get_typed_func(&mut *store, "proxy_on_done")?,
            delete: instance.get_typed_func(&mut *store, "proxy_on_delete")?,
        })
    }
}

// ---- guest memory ----

fn memory(caller: &mut Caller<'_, HostState>) -> wasmtime::Result<Memory> {
    match caller.get_export("memory") {
        Some(Extern::Memory(memory)) => Ok(memory),
        _ => Err(wasmtime::Error::msg("the module exports no memory")),
    }
}

fn read(caller: &mut Caller<'_, HostState>, ptr: i32, len: i32) -> wasmtime::Result<Vec<u8>> {
    let memory = memory(caller)?;
    let start = ptr as u32 as usize;
    let end = start
        .checked_add(len as u32 as usize)
        .ok_or_else(|| wasmtime::Error::msg("guest range overflows"))?;
    memory
        .data(&*caller)
        .get(start..end)
        .map(<[u8]>::to_vec)
        .ok_or_else(|| wasmtime::Error::msg("guest range out of bounds"))
}

fn read_string(caller: &mut Caller<'_, HostState>, ptr: i32, len: i32) -> wasmtime::Result<String> {
    Ok(String::from_utf8_lossy(&read(caller, ptr, len)?).into_owned())
}

fn write(caller: &mut Caller<'_, HostState>, ptr: i32, bytes: &[u8]) -> wasmtime::Result<()> {
    let memory = memory(caller)?;
    memory
        .write(&mut *caller, ptr as u32 as usize, bytes)
        .map_err(|_| wasmtime::Error::msg("guest write out of bounds"))
}

fn write_u32(caller: &mut Caller<'_, HostState>, ptr: i32, value: u32) -> wasmtime::Result<()> {
    write(caller, ptr, &value.to_le_bytes())
}

/// Copies `bytes` into memory the guest allocates, and stores its address and size at
/// the two return pointers (the ABI's way of returning a buffer).
fn give(
    caller: &mut Caller<'_, HostState>,
    bytes: &[u8],
    ptr_out: i32,
    len_out: i32,
) -> wasmtime::Result<i32> {
    let allocate = match caller.get_export("proxy_on_memory_allocate") {
        Some(Extern::Func(func)) => func.typed::<i32, i32>(&*caller)?,
        _ => return Err(wasmtime::Error::msg("no proxy_on_memory_allocate export")),
    };
    let len = i32::try_from(bytes.len()).map_err(|_| wasmtime::Error::msg("buffer too large"))?;
    let ptr = allocate.call(&mut *caller, len)?;
    if ptr == 0 && len > 0 {
        return Err(wasmtime::Error::msg(
            "the guest could not allocate a return buffer",
        ));
    }
    write(caller, ptr, bytes)?;
    write_u32(caller, ptr_out, ptr as u32)?;
    write_u32(caller, len_out, len as u32)?;
    Ok(status::OK)
}

/// A value the guest asked for: given if there is one, else `NotFound`.
fn give_found(
    caller: &mut Caller<'_, HostState>,
    value: Option<Vec<u8>>,
    ptr_out: i32,
    len_out: i32,
) -> wasmtime::Result<i32> {
    match value {
        Some(value) => give(caller, &value, ptr_out, len_out),
        None => Ok(status::NOT_FOUND),
    }
}

fn serialize_map(headers: &Headers) -> Vec<u8> {
    let mut bytes = (headers.len() as u32).to_le_bytes().to_vec();
    for (name, value) in headers {
        bytes.extend_from_slice(&(name.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&(value.len() as u32).to_le_bytes());
    }
    for (name, value) in headers {
        bytes.extend_from_slice(name.as_bytes());
        bytes.push(0);
        bytes.extend_from_slice(value);
        bytes.push(0);
    }
    bytes
}

fn deserialize_map(bytes: &[u8]) -> Option<Headers> {
    let word = |at: usize| -> Option<usize> {
        Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?) as usize)
    };
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let count = word(0)?;
    let mut data = 4usize.checked_add(count.checked_mul(8)?)?;
    let mut pairs = Vec::with_capacity(count.min(1024));
    for n in 0..count {
        let (name_len, value_len) = (word(4 + n * 8)?, word(8 + n * 8)?);
        let name = bytes.get(data..data + name_len)?;
        data += name_len + 1;
        let value = bytes.get(data..data + value_len)?;
        data += value_len + 1;
        pairs.push((String::from_utf8_lossy(name).into_owned(), value.to_vec()));
    }
    Some(pairs)
}

/// The header map a map type names, for the effective context.
fn header_map(state: &mut HostState, map: i32) -> Option<&mut Headers> {
    match map {
        map::REQUEST_HEADERS => state.stream().map(|s| &mut s.request_headers),
        map::RESPONSE_HEADERS => state.stream().map(|s| &mut s.response_headers),
        _ => None,
    }
}

/// Any map the filter may read: the stream's, or the answer of the callout being
/// delivered.
fn readable_map(state: &mut HostState, map: i32) -> Option<Headers> {
    if map == map::CALL_RESPONSE_HEADERS {
        call_headers(state)
    } else {
        header_map(state, map).cloned()
    }
}

/// `proxy_replace_header_map_value` (`replace`) and `proxy_add_header_map_value`.
fn write_header(
    c: &mut Ctx<'_>,
    map: i32,
    key: (i32, i32),
    value: (i32, i32),
    replace: bool,
) -> wasmtime::Result<i32> {
    let key = read_string(c, key.0, key.1)?.to_ascii_lowercase();
    let value = read(c, value.0, value.1)?;
    let Some(headers) = header_map(c.data_mut(), map) else {
        return Ok(status::BAD_ARGUMENT);
    };
    if replace {
        headers.retain(|(name, _)| *name != key);
    }
    headers.push((key, value));
    Ok(status::OK)
}

fn call_headers(state: &HostState) -> Option<Headers> {
    match state.call_response.as_ref()? {
        CallOutcome::Response { headers, .. } => Some(headers.clone()),
        CallOutcome::Failed(reason) => Some(vec![(
            ":dispatch_status".to_owned(),
            reason.as_bytes().to_vec(),
        )]),
    }
}

// ---- WASI: what a wasip1 proxy-wasm module imports ----

fn define_wasi(linker: &mut Linker<HostState>) -> anyhow::Result<()> {
    const WASI: &str = "wasi_snapshot_preview1";
    linker.func_wrap(
        WASI,
        "environ_sizes_get",
        |mut caller: Caller<'_, HostState>, count: i32, size: i32| -> wasmtime::Result<i32> {
            write_u32(&mut caller, count, 0)?;
            write_u32(&mut caller, size, 0)?;
            Ok(0)
        },
    )?;
    linker.func_wrap(WASI, "environ_get", |_: i32, _: i32| -> i32 { 0 })?;
    linker.func_wrap(
        WASI,
        "fd_write",
        |mut caller: Caller<'_, HostState>,
         _fd: i32,
         iovs: i32,
         count: i32,
         written: i32|
         -> wasmtime::Result<i32> {
            let mut text = Vec::new();
            for n in 0..count.max(0) {
                let at = n
                    .checked_mul(8)
                    .and_then(|offset| iovs.checked_add(offset))
                    .ok_or_else(|| wasmtime::Error::msg("iovec out of range"))?;
                let iov = read(&mut caller, at, 8)?;
                let word = |at: usize| {
                    iov.get(at..at + 4)
                        .and_then(|b| b.try_into().ok())
                        .map_or(0, i32::from_le_bytes)
                };
                text.extend(read(&mut caller, word(0), word(4))?);
            }
            write_u32(&mut caller, written, text.len() as u32)?;
            let line = String::from_utf8_lossy(&text).trim_end().to_owned();
            caller.data_mut().log(format!("stdio: {line}"));
            Ok(0)
        },
    )?;
    linker.func_wrap(WASI, "proc_exit", |code: i32| -> wasmtime::Result<()> {
        Err(wasmtime::Error::msg(format!("proc_exit({code})")))
    })?;
    linker.func_wrap(
        WASI,
        "random_get",
        |mut caller: Caller<'_, HostState>, ptr: i32, len: i32| -> wasmtime::Result<i32> {
            // WASI errno 29: EIO.
            if caller.data().random_source == RandomSource::Broken {
                return Ok(29);
            }
            let mut bytes = Vec::with_capacity(len as u32 as usize);
            while bytes.len() < len as u32 as usize {
                let state = caller.data_mut();
                state.random ^= state.random << 13;
                state.random ^= state.random >> 7;
                state.random ^= state.random << 17;
                bytes.extend_from_slice(&state.random.to_le_bytes());
            }
            bytes.truncate(len as u32 as usize);
            write(&mut caller, ptr, &bytes)?;
            Ok(0)
        },
    )?;
    Ok(())
}

// ---- proxy-wasm ABI 0.2.1 ----

type Ctx<'a> = Caller<'a, HostState>;

fn define_proxy_wasm(linker: &mut Linker<HostState>) -> anyhow::Result<()> {
    const ENV: &str = "env";
    linker.func_wrap(
        ENV,
        "proxy_log",
        |mut c: Ctx<'_>, level: i32, ptr: i32, len: i32| -> wasmtime::Result<i32> {
            let message = read_string(&mut c, ptr, len)?;
            c.data_mut().log(format!("[{level}] {message}"));
            Ok(status::OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_current_time_nanoseconds",
        |mut c: Ctx<'_>, out: i32| -> wasmtime::Result<i32> {
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            write(&mut c, out, &nanos.to_le_bytes())?;
            Ok(status::OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_effective_context",
        |mut c: Ctx<'_>, context: i32| -> i32 {
            let state = c.data_mut();
            let context = context as u32;
            if context == ROOT_CONTEXT || state.streams.contains_key(&context) {
                state.effective = context;
                status::OK
            } else {
                status::BAD_ARGUMENT
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_buffer_bytes",
        |mut c: Ctx<'_>,
         buffer: i32,
         start: i32,
         max: i32,
         ptr_out: i32,
         len_out: i32|
         -> wasmtime::Result<i32> {
            let state = c.data_mut();
            let bytes = match buffer {
                buffer::PLUGIN_CONFIGURATION => Some(state.plugin_configuration.clone()),
                buffer::VM_CONFIGURATION => None,
                buffer::REQUEST_BODY => state.stream().and_then(|s| s.request_body.clone()),
                buffer::RESPONSE_BODY => state.stream().map(|s| s.response_chunk.clone()),
                buffer::CALL_RESPONSE_BODY => match &state.call_response {
                    Some(CallOutcome::Response { body, .. }) => Some(body.clone()),
                    _ => None,
                },
                _ => None,
            };
            let Some(bytes) = bytes.filter(|b| !b.is_empty()) else {
                return Ok(status::NOT_FOUND);
            };
            let start = (start as u32 as usize).min(bytes.len());
            let end = start.saturating_add(max as u32 as usize).min(bytes.len());
            give(
                &mut c,
                bytes.get(start..end).unwrap_or_default(),
                ptr_out,
                len_out,
            )
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_buffer_bytes",
        |mut c: Ctx<'_>,
         buffer: i32,
         start: i32,
         size: i32,
         ptr: i32,
         len: i32|
         -> wasmtime::Result<i32> {
            let bytes = read(&mut c, ptr, len)?;
            let Some(stream) = c.data_mut().stream() else {
                return Ok(status::NOT_FOUND);
            };
            match (buffer, &mut stream.request_body) {
                (buffer::REQUEST_BODY, Some(body))
                    if start == 0 && size as u32 as usize >= body.len() =>
                {
                    *body = bytes;
                    Ok(status::OK)
                }
                _ => Ok(status::BAD_ARGUMENT),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_header_map_pairs",
        |mut c: Ctx<'_>, map: i32, ptr_out: i32, len_out: i32| -> wasmtime::Result<i32> {
            let pairs = readable_map(c.data_mut(), map);
            // A map the stream does not have is empty (the SDK panics on NotFound here).
            give(
                &mut c,
                &serialize_map(&pairs.unwrap_or_default()),
                ptr_out,
                len_out,
            )
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_header_map_pairs",
        |mut c: Ctx<'_>, map: i32, ptr: i32, len: i32| -> wasmtime::Result<i32> {
            let bytes = read(&mut c, ptr, len)?;
            let Some(pairs) = deserialize_map(&bytes) else {
                return Ok(status::BAD_ARGUMENT);
            };
            match header_map(c.data_mut(), map) {
                Some(headers) => {
                    *headers = pairs;
                    Ok(status::OK)
                }
                None => Ok(status::BAD_ARGUMENT),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_header_map_value",
        |mut c: Ctx<'_>,
         map: i32,
         key_ptr: i32,
         key_len: i32,
         ptr_out: i32,
         len_out: i32|
         -> wasmtime::Result<i32> {
            let key = read_string(&mut c, key_ptr, key_len)?.to_ascii_lowercase();
            let value = readable_map(c.data_mut(), map).and_then(|pairs| {
                pairs
                    .into_iter()
                    .find(|(name, _)| *name == key)
                    .map(|(_, v)| v)
            });
            give_found(&mut c, value, ptr_out, len_out)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_replace_header_map_value",
        |mut c: Ctx<'_>, map: i32, key_ptr: i32, key_len: i32, value_ptr: i32, value_len: i32| {
            write_header(
                &mut c,
                map,
                (key_ptr, key_len),
                (value_ptr, value_len),
                true,
            )
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_add_header_map_value",
        |mut c: Ctx<'_>, map: i32, key_ptr: i32, key_len: i32, value_ptr: i32, value_len: i32| {
            write_header(
                &mut c,
                map,
                (key_ptr, key_len),
                (value_ptr, value_len),
                false,
            )
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_remove_header_map_value",
        |mut c: Ctx<'_>, map: i32, key_ptr: i32, key_len: i32| -> wasmtime::Result<i32> {
            let key = read_string(&mut c, key_ptr, key_len)?.to_ascii_lowercase();
            let Some(headers) = header_map(c.data_mut(), map) else {
                return Ok(status::BAD_ARGUMENT);
            };
            headers.retain(|(name, _)| *name != key);
            Ok(status::OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_property",
        |mut c: Ctx<'_>,
         path_ptr: i32,
         path_len: i32,
         ptr_out: i32,
         len_out: i32|
         -> wasmtime::Result<i32> {
            let path = read_string(&mut c, path_ptr, path_len)?.replace('\0', ".");
            let state = c.data_mut();
            let value = match path.as_str() {
                "plugin_name" => Some(state.plugin_name.clone().into_bytes()),
                _ => state
                    .stream()
                    .and_then(|s| s.properties.get(&path).cloned()),
            };
            give_found(&mut c, value, ptr_out, len_out)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_property",
        |mut c: Ctx<'_>,
         path_ptr: i32,
         path_len: i32,
         value_ptr: i32,
         value_len: i32|
         -> wasmtime::Result<i32> {
            let path = read_string(&mut c, path_ptr, path_len)?.replace('\0', ".");
            let value = read(&mut c, value_ptr, value_len)?;
            // Kong's property setters: the service target (`host:port`, handed to
            // kong.service.set_target) and the shared per-request context.
            let settable = path == "kong.service.target" || path.starts_with("kong.ctx.shared.");
            if path == "kong.service.target" && !valid_target(&value) {
                return Ok(status::BAD_ARGUMENT);
            }
            match c.data_mut().stream() {
                Some(stream) if settable => {
                    stream.properties.insert(path, value);
                    Ok(status::OK)
                }
                _ => Ok(status::NOT_FOUND),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_continue_stream",
        |mut c: Ctx<'_>, stream_type: i32| -> i32 {
            match c.data_mut().stream() {
                Some(stream) if stream_type == STREAM_REQUEST => {
                    stream.resumed = true;
                    status::OK
                }
                _ => status::BAD_ARGUMENT,
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_send_local_response",
        |mut c: Ctx<'_>,
         code: i32,
         _details_ptr: i32,
         _details_len: i32,
         body_ptr: i32,
         body_len: i32,
         headers_ptr: i32,
         headers_len: i32,
         _grpc: i32|
         -> wasmtime::Result<i32> {
            let body = read(&mut c, body_ptr, body_len)?;
            let headers = read(&mut c, headers_ptr, headers_len)?;
            let Some(headers) = deserialize_map(&headers) else {
                return Ok(status::BAD_ARGUMENT);
            };
            let Some(stream) = c.data_mut().stream() else {
                return Ok(status::NOT_FOUND);
            };
            stream.local_response = Some(LocalResponse {
                status: u16::try_from(code).unwrap_or(500),
                headers,
                body,
            });
            Ok(status::OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_http_call",
        |mut c: Ctx<'_>,
         upstream_ptr: i32,
         upstream_len: i32,
         headers_ptr: i32,
         headers_len: i32,
         body_ptr: i32,
         body_len: i32,
         _trailers_ptr: i32,
         _trailers_len: i32,
         timeout_ms: i32,
         token_out: i32|
         -> wasmtime::Result<i32> {
            let upstream = read_string(&mut c, upstream_ptr, upstream_len)?;
            let headers = read(&mut c, headers_ptr, headers_len)?;
            let body = read(&mut c, body_ptr, body_len)?;
            let Some(headers) = deserialize_map(&headers) else {
                return Ok(status::BAD_ARGUMENT);
            };
            // Kong dispatches to `host[:port]`, and needs `:method` and `:path`.
            let has = |name: &str| headers.iter().any(|(n, _)| n == name);
            if !valid_target(upstream.as_bytes()) || !has(":method") || !has(":path") {
                return Ok(status::BAD_ARGUMENT);
            }
            let state = c.data_mut();
            let stream = state.effective;
            // The root context calls out from its timer (ngx_wasm_module allows it there).
            if stream != ROOT_CONTEXT {
                let Some(stream_state) = state.streams.get_mut(&stream) else {
                    return Ok(status::BAD_ARGUMENT);
                };
                stream_state.calls_made += 1;
                stream_state.calls_in_flight += 1;
            }
            let token = state.next_token;
            state.next_token += 1;
            state.pending_calls.push(CallRequest {
                token,
                stream,
                upstream,
                headers,
                body,
                timeout: Duration::from_millis(timeout_ms as u32 as u64),
            });
            write_u32(&mut c, token_out, token)?;
            Ok(status::OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_call_foreign_function",
        |_: i32, _: i32, _: i32, _: i32, _: i32, _: i32| -> i32 {
            // Kong registers only `resolve_lua`; everything else is unknown.
            status::NOT_FOUND
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_tick_period_milliseconds",
        |mut c: Ctx<'_>, period: i32| -> i32 {
            c.data_mut().tick_period_ms = period as u32;
            status::OK
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_define_metric",
        |mut c: Ctx<'_>, kind: i32, ptr: i32, len: i32, id_out: i32| -> wasmtime::Result<i32> {
            let name = read_string(&mut c, ptr, len)?;
            let state = c.data_mut();
            let full = format!("pw.{}.{name}", state.plugin_name);
            let id = match state.metrics.iter().position(|m| m.name == full) {
                Some(id) => id,
                None => {
                    state.metrics.push(Metric {
                        name: full,
                        kind,
                        value: 0,
                        samples: 0,
                    });
                    state.metrics.len() - 1
                }
            };
            write_u32(&mut c, id_out, id as u32)?;
            Ok(status::OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_increment_metric",
        |mut c: Ctx<'_>, id: i32, offset: i64| -> i32 {
            match c.data_mut().metrics.get_mut(id as u32 as usize) {
                Some(metric) => {
                    metric.value = metric.value.saturating_add(offset);
                    status::OK
                }
                None => status::NOT_FOUND,
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_record_metric",
        |mut c: Ctx<'_>, id: i32, value: i64| -> i32 {
            match c.data_mut().metrics.get_mut(id as u32 as usize) {
                Some(metric) => {
                    if metric.kind == 2 {
                        metric.value = metric.value.saturating_add(value);
                        metric.samples += 1;
                    } else {
                        metric.value = value;
                    }
                    status::OK
                }
                None => status::NOT_FOUND,
            }
        },
    )?;
    linker.func_wrap(ENV, "proxy_done", || -> i32 { status::OK })?;
    Ok(())
}

/// `host:port` with a numeric port, as Kong's `set_target` and dispatcher take it.
fn valid_target(value: &[u8]) -> bool {
    std::str::from_utf8(value)
        .ok()
        .and_then(|v| v.rsplit_once(':'))
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_maps_round_trip_and_refuse_truncation() {
        let headers = vec![
            (":path".to_owned(), b"/v1/x".to_vec()),
            ("x-bin".to_owned(), vec![0xff, 0]),
        ];
        let bytes = serialize_map(&headers);
        assert_eq!(deserialize_map(&bytes), Some(headers));
        assert_eq!(deserialize_map(&bytes[..bytes.len() - 3]), None);
        assert_eq!(deserialize_map(&[9, 0, 0, 0]), None);
    }

    #[test]
    fn targets_need_a_host_and_a_numeric_port() {
        assert!(valid_target(b"127.0.0.1:8000"));
        assert!(valid_target(b"replica-0.vllm:8000"));
        assert!(!valid_target(b"127.0.0.1"));
        assert!(!valid_target(b":8000"));
        assert!(!valid_target(b"host:http"));
    }
}
