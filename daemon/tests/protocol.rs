//! Both lookup protocols over real HTTP. A filter of the release before protocol 2 sends
//! exactly the bytes under `core/tests/wire/v1/` (written by that release's own code): this
//! daemon answers them with every field that release's daemon answered, so such a filter
//! still routes. Protocol 2 answers only the candidates asked for.

mod common;

use common::*;
use kvaffine_core::Reason;
use kvaffine_core::protocol::{self, Pick, v1};
use serde_json::{Value, json};
use vllm_emu::publisher::{EventPublisher, PublisherConfig};

const A: &str = "127.0.0.1:8000";
const B: &str = "127.0.0.1:8001";

fn wire(name: &str) -> Vec<u8> {
    std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../core/tests/wire/v1")
            .join(name),
    )
    .unwrap()
}

/// Every object key `released` has, `current` has too, recursively (arrays by their
/// first element).
fn keeps_every_field(released: &Value, current: &Value, at: &str) {
    match (released, current) {
        (Value::Object(old), Value::Object(new)) => {
            for (key, value) in old {
                let here = format!("{at}.{key}");
                let now = new
                    .get(key)
                    .unwrap_or_else(|| panic!("{here} is gone: {current}"));
                keeps_every_field(value, now, &here);
            }
        }
        (Value::Array(old), Value::Array(new)) => {
            if let (Some(old), Some(new)) = (old.first(), new.first()) {
                keeps_every_field(old, new, &format!("{at}[0]"));
            }
        }
        _ => {}
    }
}

/// Two endpoints with replay sockets; `b_holds` is published by B before the daemon
/// starts, so the daemon has it (from B's replay) once it is ready.
fn daemon_with_two_endpoints(b_holds: &[u32]) -> (DaemonProcess, [EventPublisher; 2]) {
    let ctx = zmq::Context::new();
    let start = || EventPublisher::start(&ctx, PublisherConfig::default()).unwrap();
    let (pa, pb) = (start(), start());
    if !b_holds.is_empty() {
        pb.publish(&batch(vec![stored(b_holds, 0, |d| d.block_key().0)]))
            .unwrap();
    }
    let flag = |name: &str, p: &EventPublisher| {
        let replay = p.replay_endpoint().expect("a replay socket");
        format!("{name}={},{replay}", p.endpoint())
    };
    let daemon = DaemonProcess::start(&["--endpoint", &flag(A, &pa), "--endpoint", &flag(B, &pb)]);
    daemon.wait_ready();
    (daemon, [pa, pb])
}

#[test]
fn a_protocol_1_filters_lookups_are_answered_as_that_release_answered_them() {
    let (daemon, _publishers) = daemon_with_two_endpoints(&[]);
    let released: Value = serde_json::from_slice(&wire("answer-prefix.json")).unwrap();
    for name in [
        "request-precise.json",
        "request-approximate.json",
        "request-load.json",
    ] {
        let body = String::from_utf8(wire(name)).unwrap();
        let (status, text) = daemon.request("POST", v1::LOOKUP_PATH, &body);
        assert_eq!(status, 200, "{name}: {text}");
        let answer: Value = serde_json::from_str(&text).unwrap();
        keeps_every_field(&released, &answer, name);
        let read = v1::read_answer(text.as_bytes()).unwrap();
        let pick = Pick::from_answer(&read, 1).unwrap();
        assert_eq!(pick.endpoints.len(), 2, "{name}: {text}");
        assert_eq!(
            read.booked.as_deref(),
            pick.endpoints.first().map(String::as_str)
        );
    }
}

#[test]
fn protocol_2_answers_the_candidates_asked_for_and_matches_blocks() {
    let tokens = prompt(5, 3);
    let k = keys(&tokens);
    let (daemon, _publishers) = daemon_with_two_endpoints(&tokens);
    assert_eq!(daemon.matched(&k, B), 3, "replayed before ready");
    let ask = |candidates: usize| {
        let body = json!({"blocks": k, "candidates": candidates, "book": {}}).to_string();
        let (status, text) = daemon.request("POST", protocol::LOOKUP_PATH, &body);
        assert_eq!(status, 200, "{text}");
        protocol::read_answer(text.as_bytes()).unwrap()
    };
    let one = ask(1);
    assert_eq!(one.candidates.len(), 1);
    assert_eq!(
        (
            one.candidates[0].endpoint.as_str(),
            one.candidates[0].matched_blocks
        ),
        (B, 3)
    );
    assert_eq!(
        (one.reason, one.booked.as_deref()),
        (Reason::Prefix, Some(B))
    );
    assert_eq!(ask(5).candidates.len(), 2, "no more than there are");
    let (status, text) = daemon.request(
        "POST",
        protocol::LOOKUP_PATH,
        r#"{"blocks":[1],"text":[2]}"#,
    );
    assert_eq!(status, 400, "{text}");
    assert!(
        daemon.metric("kvaffined_lookups_total{reason=\"prefix\"}") >= 1.0,
        "lookups are counted by reason"
    );
}

/// Past `--max-inflight-lookups` a lookup is refused at once with 503, counted, instead of
/// queueing behind the others; the slot comes back when the lookup holding it is done. A
/// lookup whose body has not finished arriving holds its slot, which makes the overload
/// exact.
#[test]
fn past_the_inflight_bound_a_lookup_is_refused_at_once() {
    use std::io::{Read, Write};
    let daemon = DaemonProcess::start(&["--max-inflight-lookups", "1"]);
    daemon.wait_ready();
    let body = br#"{"blocks":[]}"#;
    let hold = || {
        let mut held = std::net::TcpStream::connect(&daemon.addr).unwrap();
        write!(
            held,
            "POST /v2/lookup HTTP/1.1\r\nhost: kvaffined\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        )
        .unwrap();
        held.write_all(&body[..5]).unwrap();
        held.flush().unwrap();
        held
    };
    let mut held = hold();
    let lookup = || daemon.request("POST", protocol::LOOKUP_PATH, r#"{"blocks":[]}"#);
    wait_for("the held lookup takes the only slot", || {
        if lookup().0 == 503 {
            return true;
        }
        // The held lookup may have reached the daemon while that probe had the only slot:
        // it was refused then (503 on its own connection), and is sent again.
        held.set_nonblocking(true).unwrap();
        let mut first = [0u8; 12];
        let refused = held
            .read(&mut first)
            .is_ok_and(|n| first[..n].ends_with(b"503"));
        held.set_nonblocking(false).unwrap();
        if refused {
            held = hold();
        }
        false
    });
    let (status, text) = lookup();
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("--max-inflight-lookups"), "{text}");
    assert!(daemon.metric("kvaffined_shed_lookups_total") >= 2.0);
    held.write_all(&body[5..]).unwrap();
    let mut answer = String::new();
    held.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    wait_for("the slot is free again", || lookup().0 == 200);
}
