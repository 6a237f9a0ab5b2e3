//! An HTTP gateway around one [`Vm`], doing what Kong does around a proxy-wasm filter:
//! read the request body into a buffer (or spool it and leave the filter blind when it is
//! larger than `client_body_buffer_size`), run the request callbacks, carry out callouts
//! to `host:port`, forward to `kong.service.target` or else the service's targets in turn,
//! and run the response-header callback on the way back. Responses stream through.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use parking_lot::Mutex;
use serde_json::json;
use tokio::sync::Notify;

use crate::vm::{Action, CallOutcome, CallRequest, Headers, LocalResponse, Vm};

/// Kong's default `nginx_http_client_body_buffer_size` (8k): larger bodies go to a temp
/// file, which ngx_wasm_module cannot read.
pub const KONG_DEFAULT_BODY_BUFFER: usize = 8 * 1024;

/// Largest body the gateway accepts at all.
const MAX_BODY: usize = 64 * 1024 * 1024;

/// How long a paused request may wait for the filter before the gateway gives up.
const MAX_PAUSE: Duration = Duration::from_secs(60);

/// Path prefix the gateway answers itself (metrics and logs), never forwarded.
pub const HOST_PATH: &str = "/_wasm_host/";

/// What the gateway needs.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// The service's targets (`host:port`), balanced round robin when the filter does not
    /// set `kong.service.target`.
    pub targets: Vec<String>,
    /// `nginx_http_client_body_buffer_size`.
    pub body_buffer: usize,
}

struct Shared {
    vm: Mutex<Vm>,
    waiters: Mutex<HashMap<u32, Arc<Notify>>>,
    client: reqwest::Client,
    config: GatewayConfig,
    next_target: AtomicUsize,
}

/// Serves `vm` on `listener` until the process ends.
pub async fn serve(
    listener: tokio::net::TcpListener,
    vm: Vm,
    config: GatewayConfig,
) -> anyhow::Result<()> {
    let shared = Arc::new(Shared {
        vm: Mutex::new(vm),
        waiters: Mutex::new(HashMap::new()),
        client: reqwest::Client::builder().no_proxy().build()?,
        config,
        next_target: AtomicUsize::new(0),
    });
    let app = Router::new().fallback(handle).with_state(shared);
    axum::serve(listener, app).await?;
    Ok(())
}

/// A request the gateway answers itself with an error.
struct Refused(StatusCode, String);

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        (self.0, self.1).into_response()
    }
}

fn plain(status: StatusCode, message: impl Into<String>) -> Refused {
    Refused(status, message.into())
}

async fn handle(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    if request.uri().path().starts_with(HOST_PATH) {
        return host_endpoint(&shared, request.uri().path());
    }
    match proxy(&shared, request).await {
        Ok(response) => response,
        Err(refused) => refused.into_response(),
    }
}

fn host_endpoint(shared: &Shared, path: &str) -> Response {
    let vm = shared.vm.lock();
    match path.strip_prefix(HOST_PATH) {
        Some("metrics") => {
            let metrics: serde_json::Map<String, serde_json::Value> = vm
                .metrics()
                .iter()
                .map(|m| {
                    (
                        m.name.clone(),
                        json!({"value": m.value, "samples": m.samples}),
                    )
                })
                .collect();
            axum::Json(metrics).into_response()
        }
        Some("streams") => vm.open_streams().to_string().into_response(),
        Some("logs") => vm.logs().collect::<Vec<_>>().join("\n").into_response(),
        _ => plain(StatusCode::NOT_FOUND, "unknown host endpoint").into_response(),
    }
}

fn request_headers(request: &Request) -> Headers {
    let uri = request.uri();
    let authority = request
        .headers()
        .get("host")
        .map(|h| h.as_bytes().to_vec())
        .unwrap_or_default();
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut headers = vec![
        (
            ":method".to_owned(),
            request.method().as_str().as_bytes().to_vec(),
        ),
        (":path".to_owned(), path.as_bytes().to_vec()),
        (":authority".to_owned(), authority),
        (":scheme".to_owned(), b"http".to_vec()),
    ];
    for (name, value) in request.headers() {
        headers.push((name.as_str().to_owned(), value.as_bytes().to_vec()));
    }
    headers
}

fn trapped(vm: &Vm) -> Refused {
    plain(
        StatusCode::INTERNAL_SERVER_ERROR,
        format!("filter trapped: {}", vm.trapped().unwrap_or("unknown")),
    )
}

async fn proxy(shared: &Arc<Shared>, request: Request) -> Result<Response, Refused> {
    let headers = request_headers(&request);
    let declared = request
        .headers()
        .get("content-length")
        .and_then(|l| l.to_str().ok()?.parse::<usize>().ok());
    if declared.is_some_and(|l| l > MAX_BODY) {
        return Err(plain(StatusCode::PAYLOAD_TOO_LARGE, "body too large"));
    }
    let body = axum::body::to_bytes(request.into_body(), MAX_BODY)
        .await
        .map_err(|err| {
            // A chunked body past the limit fails with a length-limit error; anything
            // else is a body the client did not finish.
            let message = format!("cannot read the body: {err}");
            if err.into_inner().is::<http_body_util::LengthLimitError>() {
                plain(StatusCode::PAYLOAD_TOO_LARGE, "body too large")
            } else {
                plain(StatusCode::BAD_REQUEST, message)
            }
        })?;
    let buffered = (body.len() <= shared.config.body_buffer).then(|| body.to_vec());
    let notify = Arc::new(Notify::new());
    let stream = {
        let mut vm = shared.vm.lock();
        if vm.trapped().is_some() {
            return Err(trapped(&vm));
        }
        let stream = vm
            .open_stream(headers, buffered)
            .ok_or_else(|| trapped(&vm))?;
        shared.waiters.lock().insert(stream, notify.clone());
        stream
    };
    // Closes the stream (on_log, on_done) however this request ends: answered, refused,
    // or dropped by a client that went away; a streamed response carries it to the end of
    // its body.
    let closer = StreamCloser {
        shared: shared.clone(),
        stream,
    };
    Ok(
        match run_request(shared, stream, &notify, body.to_vec()).await {
            Ok(Next::Forward(forward)) => match respond(shared, stream, forward, closer).await {
                Ok(response) => response,
                Err(refused) => refused.into_response(),
            },
            Ok(Next::Local(local)) => {
                build_response(local.status, &local.headers, Body::from(local.body))
            }
            Err(refused) => refused.into_response(),
        },
    )
}

/// Where the request goes once the filter is done with it.
enum Next {
    Forward(Forward),
    Local(LocalResponse),
}

/// The request as the filter left it.
struct Forward {
    target: String,
    headers: Headers,
    body: Vec<u8>,
}

async fn run_request(
    shared: &Arc<Shared>,
    stream: u32,
    notify: &Notify,
    original_body: Vec<u8>,
) -> Result<Next, Refused> {
    let paused = {
        let mut vm = shared.vm.lock();
        // A pause in the headers asks Kong to read the body, and a pause at its end holds
        // the request. ngx_wasm_module may not run the body step for an empty body: this
        // host never does, so a filter that waits for one hangs here as it could on Kong.
        let headers = vm.on_request_headers(stream).ok_or_else(|| trapped(&vm))?;
        let size = vm
            .stream_state(stream)
            .and_then(|s| s.request_body.as_ref())
            .map_or(original_body.len(), Vec::len);
        let action = if original_body.is_empty() {
            headers
        } else {
            vm.on_request_body(stream, size)
                .ok_or_else(|| trapped(&vm))?
        };
        dispatch(shared, &mut vm);
        action == Action::Pause
    };
    if paused {
        let waited = tokio::time::timeout(MAX_PAUSE, async {
            loop {
                {
                    let vm = shared.vm.lock();
                    if vm.trapped().is_some() {
                        return;
                    }
                    let Some(state) = vm.stream_state(stream) else {
                        return;
                    };
                    // Kong also resumes by itself once every callout has been answered.
                    let calls_done = state.calls_made > 0 && state.calls_in_flight == 0;
                    if state.resumed || state.local_response.is_some() || calls_done {
                        return;
                    }
                }
                notify.notified().await;
            }
        })
        .await;
        if waited.is_err() {
            return Err(plain(
                StatusCode::GATEWAY_TIMEOUT,
                "the filter never resumed the request",
            ));
        }
    }
    let vm = shared.vm.lock();
    if vm.trapped().is_some() {
        return Err(trapped(&vm));
    }
    let state = vm
        .stream_state(stream)
        .ok_or_else(|| plain(StatusCode::INTERNAL_SERVER_ERROR, "stream lost"))?;
    if let Some(local) = &state.local_response {
        return Ok(Next::Local(local.clone()));
    }
    let target = match state.properties.get("kong.service.target") {
        Some(target) => String::from_utf8_lossy(target).into_owned(),
        None => round_robin(shared)?,
    };
    Ok(Next::Forward(Forward {
        target,
        headers: state.request_headers.clone(),
        body: state.request_body.clone().unwrap_or(original_body),
    }))
}

fn round_robin(shared: &Shared) -> Result<String, Refused> {
    let targets = &shared.config.targets;
    let n = shared.next_target.fetch_add(1, Ordering::Relaxed);
    targets
        .get(n % targets.len().max(1))
        .cloned()
        .ok_or_else(|| plain(StatusCode::SERVICE_UNAVAILABLE, "no targets"))
}

/// Starts every callout the filter made; each answer goes back into the VM on arrival.
fn dispatch(shared: &Arc<Shared>, vm: &mut Vm) {
    for call in vm.take_calls() {
        let shared = shared.clone();
        tokio::spawn(async move {
            let outcome = call_upstream(&shared.client, &call).await;
            let notify = {
                let mut vm = shared.vm.lock();
                vm.on_http_call_response(&call, outcome);
                dispatch(&shared, &mut vm);
                shared.waiters.lock().get(&call.stream).cloned()
            };
            if let Some(notify) = notify {
                notify.notify_one();
            }
        });
    }
}

async fn call_upstream(client: &reqwest::Client, call: &CallRequest) -> CallOutcome {
    let header = |name: &str| {
        call.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    };
    let method = header(":method").unwrap_or_default();
    let Ok(method) = reqwest::Method::from_bytes(method.as_bytes()) else {
        return CallOutcome::Failed("bad method");
    };
    let url = format!(
        "http://{}{}",
        call.upstream,
        header(":path").unwrap_or_default()
    );
    let mut builder = client.request(method, url).body(call.body.clone());
    if !call.timeout.is_zero() {
        builder = builder.timeout(call.timeout);
    }
    for (name, value) in &call.headers {
        if name.starts_with(':') {
            continue;
        }
        builder = builder.header(name.as_str(), value.as_slice());
    }
    if let Some(authority) = header(":authority") {
        builder = builder.header("host", authority);
    }
    match builder.send().await {
        Ok(response) => {
            let mut headers = vec![(
                ":status".to_owned(),
                response.status().as_str().as_bytes().to_vec(),
            )];
            for (name, value) in response.headers() {
                headers.push((name.as_str().to_owned(), value.as_bytes().to_vec()));
            }
            match response.bytes().await {
                Ok(body) => CallOutcome::Response {
                    headers,
                    body: body.to_vec(),
                },
                Err(err) if err.is_timeout() => CallOutcome::Failed("timeout"),
                Err(_) => CallOutcome::Failed("broken connection"),
            }
        }
        Err(err) if err.is_timeout() => CallOutcome::Failed("timeout"),
        Err(_) => CallOutcome::Failed("broken connection"),
    }
}

/// Hop-by-hop and framing headers the gateway sets itself.
fn forwarded(name: &str) -> bool {
    !name.starts_with(':')
        && !matches!(
            name,
            "host" | "connection" | "content-length" | "transfer-encoding" | "keep-alive"
        )
}

async fn respond(
    shared: &Arc<Shared>,
    stream: u32,
    forward: Forward,
    closer: StreamCloser,
) -> Result<Response, Refused> {
    let path = forward
        .headers
        .iter()
        .find(|(n, _)| n == ":path")
        .map_or_else(
            || "/".to_owned(),
            |(_, v)| String::from_utf8_lossy(v).into_owned(),
        );
    let method = forward
        .headers
        .iter()
        .find(|(n, _)| n == ":method")
        .and_then(|(_, v)| reqwest::Method::from_bytes(v).ok())
        .unwrap_or(reqwest::Method::GET);
    let mut builder = shared
        .client
        .request(method, format!("http://{}{path}", forward.target))
        .body(forward.body);
    for (name, value) in &forward.headers {
        if forwarded(name) {
            builder = builder.header(name.as_str(), value.as_slice());
        }
    }
    let upstream = builder
        .send()
        .await
        .map_err(|err| plain(StatusCode::BAD_GATEWAY, format!("upstream: {err}")))?;
    let mut headers = vec![(
        ":status".to_owned(),
        upstream.status().as_str().as_bytes().to_vec(),
    )];
    for (name, value) in upstream.headers() {
        headers.push((name.as_str().to_owned(), value.as_bytes().to_vec()));
    }
    // Which target served, as envoy/gateway.yaml adds it in Envoy: tests compare it with
    // the filter's pick.
    headers.push(("x-served-by".to_owned(), forward.target.into_bytes()));
    let status = upstream.status().as_u16();
    let headers = {
        let mut vm = shared.vm.lock();
        vm.on_response_headers(stream, headers)
            .ok_or_else(|| trapped(&vm))?
    };
    // The stream closes (on_log, on_done) when the body has been sent or dropped.
    let body = upstream.bytes_stream().map(move |chunk| {
        let _open = &closer;
        chunk
    });
    Ok(build_response(status, &headers, Body::from_stream(body)))
}

fn build_response(status: u16, headers: &Headers, body: Body) -> Response {
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    for (name, value) in headers {
        if !forwarded(name) {
            continue;
        }
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value),
        ) {
            response.headers_mut().append(name, value);
        }
    }
    response
}

fn finish(shared: &Shared, stream: u32) {
    shared.waiters.lock().remove(&stream);
    shared.vm.lock().close_stream(stream);
}

struct StreamCloser {
    shared: Arc<Shared>,
    stream: u32,
}

impl Drop for StreamCloser {
    fn drop(&mut self) {
        finish(&self.shared, self.stream);
    }
}

/// Binds `addr` and returns the listener with its actual address.
pub async fn bind(addr: SocketAddr) -> anyhow::Result<(tokio::net::TcpListener, SocketAddr)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    Ok((listener, local))
}
