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
