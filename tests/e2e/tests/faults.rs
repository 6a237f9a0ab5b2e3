//! Faults under traffic: the gateway keeps answering, routing degrades, then recovers.
//! Each test counts client-visible failures (which must be 0) and measures the time from
//! the repair to the first request routed by prefix again.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvaffine_e2e::client::post_json;
use kvaffine_e2e::{Stack, StackConfig, poll};
use serde_json::{Value, json};

/// Sequential traffic on one conversation-like prompt until stopped; returns the statuses.
struct Traffic {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicUsize>,
    thread: JoinHandle<Vec<u16>>,
}

fn prompt(n: usize) -> Value {
    let text: String = (0..300)
        .map(|i| format!("f{} ", (i * 31 + n) % 997))
        .collect();
    json!({"messages": [{"role": "user", "content": text}], "max_tokens": 2, "cache_salt": format!("c{}", n % 3)})
}

impl Traffic {
    fn start(gateway: &str) -> Self {
        let gateway = gateway.to_owned();
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicUsize::new(0));
        let (s, n) = (stop.clone(), sent.clone());
        let thread = std::thread::spawn(move || {
            let mut statuses = Vec::new();
            while !s.load(Ordering::Relaxed) {
                let i = n.fetch_add(1, Ordering::Relaxed);
                statuses.push(post_json(&gateway, "/v1/chat/completions", &prompt(i)).status);
            }
            statuses
        });
        Self { stop, sent, thread }
    }

    fn wait_for_more(&self, more: usize) {
        let target = self.sent.load(Ordering::Relaxed) + more;
        poll("traffic", Duration::from_secs(30), || {
            self.sent.load(Ordering::Relaxed) >= target
        })
        .unwrap();
    }

    fn finish(self) -> Vec<u16> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

/// Time until a request is routed by prefix again.
fn time_to_prefix(stack: &Stack) -> Duration {
    let start = Instant::now();
    poll("routing by prefix again", Duration::from_secs(30), || {
        post_json(&stack.gateway, "/v1/chat/completions", &prompt(0)).header("x-kvaffine-reason")
            == Some("prefix")
    })
    .unwrap();
    start.elapsed()
}

fn send_signal(pid: u32, signal: &str) {
    assert!(
        std::process::Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
}

fn assert_no_failures(statuses: &[u16]) {
    assert!(statuses.len() >= 10, "only {} requests", statuses.len());
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
}

#[test]
fn the_daemon_killed_and_restarted_under_load() {
    let mut stack = Stack::start(StackConfig::default()).unwrap();
    let traffic = Traffic::start(&stack.gateway);
    traffic.wait_for_more(10);
    stack.kill_daemon();
    traffic.wait_for_more(10);
    stack.restart_daemon().unwrap();
    let recovered = time_to_prefix(&stack);
    traffic.wait_for_more(10);
    assert_no_failures(&traffic.finish());
    println!("daemon restart: routing by prefix again {recovered:?} after the restart");
}

#[test]
fn a_frozen_daemon_times_out_and_requests_pass_unpinned() {
    let stack = Stack::start(StackConfig {
        filter: json!({"timeout_ms": 100}),
        ..StackConfig::default()
    })
    .unwrap();
    let traffic = Traffic::start(&stack.gateway);
    traffic.wait_for_more(5);
    stack.freeze_daemon(true).unwrap();
    traffic.wait_for_more(10);
    let during = post_json(&stack.gateway, "/v1/chat/completions", &prompt(0));
    assert_eq!(during.status, 200);
    assert_eq!(
        during.header("x-kvaffine-reason"),
        Some("index-unavailable")
    );
    stack.freeze_daemon(false).unwrap();
    let recovered = time_to_prefix(&stack);
    assert_no_failures(&traffic.finish());
    println!("frozen daemon: routing by prefix again {recovered:?} after it thawed");
}

#[test]
fn a_replica_restarted_under_load() {
    let mut stack = Stack::start(StackConfig::default()).unwrap();
    let traffic = Traffic::start(&stack.gateway);
    traffic.wait_for_more(10);
    // A crash loses in-flight requests on that replica (a backend failure); what matters
    // is that nothing else fails and routing recovers once it is back.
    stack.replicas[0].restart();
    let recovered = time_to_prefix(&stack);
    traffic.wait_for_more(10);
    let statuses = traffic.finish();
    let failed = statuses.iter().filter(|s| **s != 200).count();
    assert!(failed <= 1, "{failed} failed of {}", statuses.len());
    println!(
        "replica restart: routing by prefix again {recovered:?} after it came back; {failed} requests failed"
    );
}

#[test]
fn a_dead_tokenizer_replica_never_fails_a_request() {
    let mut stack = Stack::start(StackConfig::default()).unwrap();
    let traffic = Traffic::start(&stack.gateway);
    traffic.wait_for_more(10);
    // Replica 1 serves as a tokenizer too; kill it for good.
    stack.replicas[1].kill();
    traffic.wait_for_more(20);
    let statuses = traffic.finish();
    // Requests in flight on the dead replica at the moment it died may fail; none after.
    let tail = &statuses[statuses.len().saturating_sub(15)..];
    assert!(tail.iter().all(|s| *s == 200), "{statuses:?}");
}

/// A replica frozen with a streamed request pinned to it (kvaffined has not noticed: it
/// scrapes too rarely here): Envoy gives it `stream_headers_timeout_ms` to start the
/// answer, then retries the next replica the filter ranked, and the client gets the whole
/// stream. A non-streamed request is given no such deadline: it waits for its replica.
#[test]
fn a_frozen_replicas_streamed_request_is_answered_by_the_next_ranked_one() {
    let stack = Stack::start(StackConfig {
        filter: json!({"stream_headers_timeout_ms": 300}),
        // kvaffined scrapes once here (it must not notice the freeze), so it cannot
        // measure how fast the replicas are: they are instant, and the flag says so (at
        // the default 40 ms each, the warm replica's repeated fully cached requests
        // below, which no event confirms, would queue it past the cold one).
        daemon_args: vec![
            "--scrape-interval-ms".into(),
            "600000".into(),
            "--prefill-tokens-per-second".into(),
            "1e9".into(),
            "--request-overhead-tokens".into(),
            "0".into(),
        ],
        ..StackConfig::default()
    })
    .unwrap();
    let prompt: Vec<u32> = (0..64).map(|i| 1_000 + i).collect();
    let body = |stream: bool| json!({"prompt": prompt, "max_tokens": 2, "stream": stream});
    // Turn 1, then the same prompt until kvaffined has its blocks and pins it warm.
    let warm = post_json(&stack.gateway, "/v1/completions", &body(false))
        .header("x-served-by")
        .unwrap()
        .to_owned();
    poll("the prompt pinned warm", Duration::from_secs(10), || {
        let reply = post_json(&stack.gateway, "/v1/completions", &body(false));
        reply.header("x-kvaffine-reason") == Some("prefix")
            && reply.header("x-served-by") == Some(warm.as_str())
    })
    .unwrap();
    let frozen = stack.replicas.iter().find(|r| r.http == warm).unwrap();
    let signal = |signal: &str| send_signal(frozen.pid().unwrap(), signal);
    let timeouts = stack.stat("cluster.pool.upstream_rq_per_try_timeout");
    signal("-STOP");
    // A non-streamed answer's headers come with its last token: no deadline is set on it,
    // so it waits for the replica, here frozen for a second (three timeouts' worth). It is
    // at the frozen replica before the stream is sent, so before the stream's retry puts
    // the prompt on the other replica.
    let active = stack.stat("cluster.pool.upstream_rq_active");
    let waiting = {
        let (gateway, body) = (stack.gateway.clone(), body(false));
        std::thread::spawn(move || post_json(&gateway, "/v1/completions", &body))
    };
    poll(
        "the request at the frozen replica",
        Duration::from_secs(10),
        || stack.stat("cluster.pool.upstream_rq_active") > active,
    )
    .unwrap();
    let frozen_at = std::time::Instant::now();
    let reply = post_json(&stack.gateway, "/v1/completions", &body(true));
    std::thread::sleep(Duration::from_secs(1).saturating_sub(frozen_at.elapsed()));
    signal("-CONT");
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-kvaffine-endpoint"), Some(warm.as_str()));
    assert_ne!(reply.header("x-served-by"), Some(warm.as_str()));
    assert!(reply.body.contains("data: [DONE]"), "{}", reply.body);
    let waited = waiting.join().unwrap();
    assert_eq!(waited.status, 200, "{}", waited.body);
    assert_eq!(waited.header("x-served-by"), Some(warm.as_str()));
    assert_eq!(
        stack.stat("cluster.pool.upstream_rq_per_try_timeout") - timeouts,
        1.0
    );
}

/// A replica whose engine died while its HTTP server lives on (generation answers 500,
/// `/health` 503: on vLLM 0.32.0, by its code, only until its launcher shuts the server
/// down; the emulator holds the state for the test): a request
/// pinned to it is retried on the next ranked replica, and once kvaffined's scrape has seen
/// the failing health it stops pinning it, even for a prefix only it holds; revived, it is
/// pinned again.
#[test]
fn a_replica_whose_engine_died_is_retried_around_then_ranked_last() {
    let stack = Stack::start(StackConfig::default()).unwrap();
    // The same prompt sent until it is pinned warm stores no new block, so no event
    // confirms it: it drains from the warm replica's queue at the speed kvaffined knows,
    // measured instant here.
    stack.wait_speeds_measured().unwrap();
    // Prompts of `blocks` 16-token blocks, each a continuation of the shorter ones of its
    // `family`.
    let prompt = |family: u32, blocks: u32| {
        let tokens: Vec<u32> = (0..blocks * 16).map(|i| family * 10_000 + i).collect();
        json!({"prompt": tokens, "max_tokens": 2})
    };
    let send = |body: &Value| post_json(&stack.gateway, "/v1/completions", body);
    let warm = send(&prompt(1, 4))
        .header("x-served-by")
        .unwrap()
        .to_owned();
    let pinned_warm = |body: &Value| {
        let reply = send(body);
        reply.header("x-kvaffine-reason") == Some("prefix")
            && reply.header("x-served-by") == Some(warm.as_str())
    };
    poll("the prompt pinned warm", Duration::from_secs(10), || {
        pinned_warm(&prompt(1, 4))
    })
    .unwrap();
    // Two continuations only the warm replica holds: one for while it is dead, one for
    // after.
    assert!(pinned_warm(&prompt(1, 6)));
    // New prompts take turns between idle replicas: the first new family that lands on
    // the warm replica is its alone.
    let family = (2..20)
        .find(|&f| send(&prompt(f, 4)).header("x-served-by") == Some(warm.as_str()))
        .unwrap();
    let later = prompt(family, 6);
    let replica = stack.replicas.iter().find(|r| r.http == warm).unwrap();
    let engine = |dead: bool| {
        assert_eq!(
            replica.post("/debug/engine_dead", &json!({"dead": dead})).0,
            204
        );
    };
    engine(true);
    // Pinned to the dead replica before kvaffined knows: Envoy's retry answers it.
    let reply = send(&prompt(1, 4));
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_ne!(reply.header("x-served-by"), Some(warm.as_str()));
    // What kvaffined last saw of the replica's `/metrics` and `/health`.
    let scrape_error = || {
        let (_, endpoints) =
            vllm_emu::harness::http(&stack.daemon_addr, "GET", "/v1/endpoints", "");
        serde_json::from_str::<Value>(&endpoints).unwrap()["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["endpoint"] == warm.as_str())
            .unwrap()["status"]["scrape_error"]
            .as_str()
            .map(str::to_owned)
    };
    poll(
        "kvaffined seeing the failed health",
        Duration::from_secs(10),
        || scrape_error().is_some_and(|err| err.contains("/health")),
    )
    .unwrap();
    // Six blocks on the dead replica, four elsewhere: the live replica is pinned.
    let reply = send(&prompt(1, 7));
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_ne!(reply.header("x-kvaffine-endpoint"), Some(warm.as_str()));
    engine(false);
    poll(
        "kvaffined seeing it healthy",
        Duration::from_secs(10),
        || scrape_error().is_none(),
    )
    .unwrap();
    assert!(pinned_warm(&later));
}

/// A replica frozen (`SIGSTOP`) is not asked to tokenize once kvaffined has noticed
/// ([`Stack::check_tokenizing_avoids`]).
#[test]
fn tokenizer_callouts_avoid_a_frozen_replica() {
    let stack = Stack::start(StackConfig::default()).unwrap();
    stack.wait_scraped().unwrap();
    let (frozen, live) = (&stack.replicas[1], &stack.replicas[0].http);
    let pid = frozen.pid().unwrap();
    send_signal(pid, "-STOP");
    let checked = stack.check_tokenizing_avoids(&frozen.http, live, prompt, true);
    send_signal(pid, "-CONT");
    checked.unwrap();
}

/// Every replica's tokenizer slower than the filter's deadline (`timeout_ms`, 3 s here, so
/// that a tenth of it is room enough on a loaded machine): a request loses its precision,
/// never its pin, whichever way it is tokenized. The filter's own tokenizer callout times
/// out; kvaffined gives a route callout's tokenizer call what is left of the deadline less
/// a tenth and answers 502 before the filter gives up. Either way the filter keys the text
/// and pins (`approximate`), where a route callout left to time out would pass the request
/// on unpinned (`index-unavailable`).
#[test]
fn a_tokenizer_slower_than_the_deadline_costs_precision_never_the_pin() {
    let stack = Stack::start(StackConfig {
        filter: json!({"timeout_ms": 3_000}),
        ..StackConfig::default()
    })
    .unwrap();
    stack.wait_scraped().unwrap();
    for replica in &stack.replicas {
        let (status, answer) = replica.post("/debug/tokenizer_delay", &json!({"ms": 10_000}));
        assert_eq!(status, 204, "{answer}");
    }
    for (i, path) in [
        "/v1/chat/completions",
        "/index-tokenized/v1/chat/completions",
    ]
    .into_iter()
    .enumerate()
    {
        let reply = post_json(&stack.gateway, path, &prompt(40 + i));
        assert_eq!(reply.status, 200, "{path}: {}", reply.body);
        let routed = (
            reply.header("x-kvaffine-mode"),
            reply.header("x-kvaffine-endpoint"),
        );
        assert_eq!(
            routed,
            (Some("approximate"), reply.header("x-served-by")),
            "{path}: {:?}",
            reply.headers
        );
    }
    // Both fell back because their tokenizer failed.
    assert_eq!(
        stack.stat("wasmcustom.kvaffine.unpinned.tokenize-failed"),
        2.0
    );
    // kvaffined's one tokenizer call was made and given up after the deadline's nine
    // tenths (2.7 s less what came before it): not a refusal without a call, nor a wait
    // to the filter's deadline.
    let calls = (
        stack.daemon_metric("kvaffined_route_tokenize_failures_total"),
        stack.daemon_metric("kvaffined_route_tokenize_seconds_count"),
    );
    assert_eq!(calls, (1.0, 1.0));
    let waited = stack.daemon_metric("kvaffined_route_tokenize_seconds_sum");
    assert!((2.0..3.0).contains(&waited), "{waited} s");
}

/// Two gateways, their daemons peered; the second's kvaffined killed and started again
/// between each fresh prefix's first request (through the first gateway) and its three
/// siblings (through the second), all before the replicas' events (3 s late). The
/// restarted daemon takes the first daemon's bookings before it answers a lookup, so every
/// sibling is served from cache where its first request went, as the emulator reports.
#[test]
fn a_peered_daemon_that_restarts_keeps_siblings_with_their_first_request() {
    use kvaffine_e2e::scenarios::{self, Engine, GatewayDaemons, PROFILES, Topology};
    let precise = PROFILES.into_iter().find(|p| p.name == "precise").unwrap();
    let run = scenarios::run(
        &mut Engine::emu(),
        &scenarios::daemon_restart(true),
        precise,
        "",
        Topology::Gateways {
            count: 2,
            daemons: GatewayDaemons::Peered,
        },
    )
    .unwrap();
    assert_eq!(run.turns.len(), 24);
    for burst in run.turns.chunks(4) {
        let (first, siblings) = burst.split_first().unwrap();
        assert!(first.ok);
        for sibling in siblings {
            assert!(sibling.ok);
            assert_eq!(sibling.replica, first.replica, "{:?}", sibling.reason);
            assert!(
                sibling.cached_tokens * 10 >= sibling.prompt_tokens * 9,
                "{} of {} cached",
                sibling.cached_tokens,
                sibling.prompt_tokens
            );
        }
    }
}
