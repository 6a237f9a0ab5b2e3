//! `vllm-emu` as a router sees it: a real process, real HTTP and real ZMQ on loopback.

use std::time::{Duration, Instant};

use kvaffine_core::events::{self, EventFormat, KvEvent};
use kvaffine_core::{CacheSalt, HashAlgo, KeyConfig, KeyExtras, VllmCompat};
use serde_json::{Value, json};
use vllm_emu::harness::{EmuProcess, wait_for};

/// A SUB socket on a replica's events, collecting decoded batches.
struct Events {
    _context: zmq::Context,
    socket: zmq::Socket,
}

impl Events {
    fn subscribe(endpoint: &str) -> Self {
        let context = zmq::Context::new();
        let socket = context.socket(zmq::SUB).unwrap();
        socket.connect(endpoint).unwrap();
        socket.set_subscribe(b"").unwrap();
        Self {
            _context: context,
            socket,
        }
    }

    /// Every (seq, payload) received within `within`.
    fn drain(&self, within: Duration) -> Vec<(u64, Vec<u8>)> {
        let deadline = Instant::now() + within;
        let mut out = Vec::new();
        while Instant::now() < deadline {
            if self.socket.poll(zmq::POLLIN, 20).unwrap() > 0 {
                let frames = self.socket.recv_multipart(0).unwrap();
                let live = events::parse_live(&frames).unwrap();
                out.push((live.seq, live.payload.to_vec()));
            }
        }
        out
    }
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

fn long_text(words: usize, seed: usize) -> String {
    (0..words)
        .map(|i| format!("w{}", (i * 7919 + seed) % 5003))
        .collect::<Vec<_>>()
        .join(" ")
}

fn chat(emu: &EmuProcess, body: Value) -> Value {
    let (status, answer) = emu.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{answer}");
    answer
}

fn cached(answer: &Value) -> u64 {
    answer
        .pointer("/usage/prompt_tokens_details/cached_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(u64::MAX)
}

#[test]
fn tokenize_matches_generation_and_errors_like_vllm() {
    let emu = EmuProcess::start(&["--block-size", "16"]);
    let messages = json!([user(&long_text(100, 1))]);
    let (status, tokenized) = emu.post(
        "/tokenize",
        &json!({"messages": messages, "return_token_strs": true}),
    );
    assert_eq!(status, 200, "{tokenized}");
    let count = tokenized["count"].as_u64().unwrap();
    assert_eq!(tokenized["tokens"].as_array().unwrap().len() as u64, count);
    assert_eq!(
        tokenized["token_strs"].as_array().unwrap().len() as u64,
        count
    );
    let answer = chat(&emu, json!({"messages": messages, "max_tokens": 8}));
    assert_eq!(
        answer["usage"]["prompt_tokens"].as_u64(),
        Some(count),
        "/tokenize and generation agree"
    );

    let (status, plain) = emu.post("/tokenize", &json!({"prompt": "hello world"}));
    assert_eq!((status, plain["token_strs"].clone()), (200, Value::Null));
    assert_eq!(plain["tokens"].as_array().unwrap().len(), 2);

    let (status, error) = emu.post(
        "/tokenize",
        &json!({"messages": messages, "add_generation_prompt": true, "continue_final_message": true}),
    );
    assert_eq!(status, 400);
    assert_eq!(error["error"]["type"], "BadRequestError");
    let (status, _) = emu.post(
        "/tokenize",
        &json!({"messages": messages, "chat_template": "{{x}}"}),
    );
    assert_eq!(status, 400);
    let (status, error) = emu.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "cache_salt": "a/b"}),
    );
    assert_eq!(
        (status, error["error"]["param"].clone()),
        (400, json!("cache_salt"))
    );
    let (status, _) = emu.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "model": "nope"}),
    );
    assert_eq!(status, 404);
}

#[test]
fn reasoning_effort_and_tools_change_the_prompt_and_tokenize_only_sees_kwargs() {
    let emu = EmuProcess::start(&[]);
    let messages = json!([user("hi")]);
    let tokens = |body: Value| emu.post("/tokenize", &body).1["tokens"].clone();
    let plain = tokens(json!({"messages": messages}));
    // /tokenize ignores reasoning_effort (an unknown field there), as vLLM does...
    assert_eq!(
        tokens(json!({"messages": messages, "reasoning_effort": "high"})),
        plain
    );
    // ...so a router must pass it in chat_template_kwargs to see what chat completions renders.
    let effort =
        tokens(json!({"messages": messages, "chat_template_kwargs": {"reasoning_effort": "high"}}));
    assert_ne!(effort, plain);
    let answer = chat(
        &emu,
        json!({"messages": messages, "reasoning_effort": "high", "max_tokens": 4}),
    );
    assert_eq!(
        answer["usage"]["prompt_tokens"].as_u64(),
        Some(effort.as_array().unwrap().len() as u64)
    );
    let tools = json!([{"type": "function", "function": {"name": "search", "parameters": {}}}]);
    assert_ne!(tokens(json!({"messages": messages, "tools": tools})), plain);
}

#[test]
fn tokenize_reads_reasoning_but_not_reasoning_content_as_vllm_does() {
    let emu = EmuProcess::start(&[]);
    // A tool-call loop after the last user turn: its reasoning is rendered.
    let turn = |key: &str| {
        json!([user("weather?"),
               {"role": "assistant", "content": "", key: "call the tool"},
               {"role": "tool", "content": "sunny"}])
    };
    let count =
        |messages: Value| emu.post("/tokenize", &json!({"messages": messages})).1["count"].as_u64();
    let prompt = |messages: Value| {
        chat(&emu, json!({"messages": messages, "max_tokens": 1}))["usage"]["prompt_tokens"]
            .as_u64()
    };
    // Chat completions render the deprecated name; /tokenize (vLLM 0.32) does not...
    assert!(count(turn("reasoning_content")) < prompt(turn("reasoning_content")));
    // ...and both render `reasoning`.
    assert_eq!(count(turn("reasoning")), prompt(turn("reasoning_content")));
    assert_eq!(count(turn("reasoning")), prompt(turn("reasoning")));
}

#[test]
fn a_continuation_is_served_from_the_cache_and_salts_isolate() {
    let emu = EmuProcess::start(&["--block-size", "16"]);
    let first = json!([user(&long_text(400, 2))]);
    let cold = chat(
        &emu,
        json!({"messages": first, "cache_salt": "tenant-a", "max_tokens": 24}),
    );
    assert_eq!(cached(&cold), 0);
    let mut history = first.as_array().unwrap().clone();
    history.push(cold["choices"][0]["message"].clone());
    history.push(user("and then?"));
    let warm = chat(
        &emu,
        json!({"messages": history, "cache_salt": "tenant-a", "max_tokens": 8}),
    );
    let prompt = cold["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached(&warm) >= prompt / 16 * 16 - 16,
        "{} of {prompt} cached",
        cached(&warm)
    );
    let other = chat(
        &emu,
        json!({"messages": history, "cache_salt": "tenant-b", "max_tokens": 8}),
    );
    assert_eq!(cached(&other), 0, "another salt never shares a block");
    let unsalted = chat(&emu, json!({"messages": history, "max_tokens": 8}));
    assert_eq!(cached(&unsalted), 0);
    let again = chat(
        &emu,
        json!({"messages": history, "cache_salt": "tenant-b", "max_tokens": 8}),
    );
    assert!(cached(&again) > 0, "the same salt shares");
}

#[test]
fn warm_prefill_takes_a_fraction_of_cold_prefill() {
    let emu = EmuProcess::start(&["--time-scale", "0.5"]);
    let messages = json!([user(&long_text(3000, 3))]);
    let timed = |salt: &str| {
        let start = Instant::now();
        let answer = chat(
            &emu,
            json!({"messages": messages, "cache_salt": salt, "max_tokens": 1}),
        );
        (start.elapsed(), cached(&answer))
    };
    let (cold, cold_cached) = timed("s");
    let (warm, warm_cached) = timed("s");
    assert_eq!(cold_cached, 0);
    assert!(warm_cached > 2800);
    // Modelled: cold about 310 ms, warm about 50 ms at this scale.
    assert!(warm * 2 < cold, "warm {warm:?} vs cold {cold:?}");
}

#[test]
fn events_are_vllm_batches_and_their_keys_are_kvaffines() {
    let emu = EmuProcess::start(&["--block-size", "16", "--num-gpu-blocks", "24"]);
    let sub = Events::subscribe(&emu.events);
    let keys = KeyConfig::new(HashAlgo::Sha256Cbor, 16, None, VllmCompat::V0_31).unwrap();
    // Publish until the subscription is live (ZMQ drops messages before it joins).
    let mut received = Vec::new();
    // A new prompt each attempt (a cached one publishes nothing) until the subscription
    // has seen a BlockStored.
    let stored_batch = |received: &[(u64, Vec<u8>)]| {
        received
            .iter()
            .find(|(_, p)| {
                matches!(
                    events::decode_batch(p).map(|b| b.events.into_iter().next()),
                    Ok(Some(KvEvent::BlockStored(_)))
                )
            })
            .cloned()
    };
    let mut attempt = 0;
    wait_for("a first batch", || {
        attempt += 1;
        chat(
            &emu,
            json!({"messages": [user(&long_text(60, 4 + attempt))], "cache_salt": "t", "max_tokens": 4}),
        );
        received.extend(sub.drain(Duration::from_millis(100)));
        stored_batch(&received).is_some()
    });
    let (_, payload) = &stored_batch(&received).unwrap();
    let batch = events::decode_batch(payload).unwrap();
    assert_eq!(
        events::encode_batch(&batch, EventFormat::Map),
        *payload,
        "msgspec's byte layout"
    );
    assert_eq!(&payload[..2], &[0x93, 0xcb]);
    let KvEvent::BlockStored(stored) = &batch.events[0] else {
        panic!("{batch:?}")
    };
    assert_eq!(stored.parent_block_hash, None);
    assert_eq!(stored.medium.as_deref(), Some("GPU"));
    assert_eq!(
        stored.extra_keys.as_ref().unwrap()[0].as_ref().unwrap()[0],
        events::ExtraKey::Text("t".into())
    );
    let extras = KeyExtras {
        cache_salt: Some(CacheSalt::parse("t").unwrap()),
        ..KeyExtras::default()
    };
    let ours: Vec<u64> = keys
        .digests(&extras, &stored.token_ids)
        .iter()
        .map(|d| d.block_key().0)
        .collect();
    let published: Vec<u64> = stored
        .block_hashes
        .iter()
        .map(|h| h.block_key().0)
        .collect();
    assert_eq!(published, ours);

    // A 24-block cache cannot hold these: older blocks are evicted and reported.
    for n in 0..6 {
        chat(
            &emu,
            json!({"messages": [user(&long_text(100, 10 + n))], "max_tokens": 2}),
        );
    }
    let later = sub.drain(Duration::from_millis(300));
    let removed = later
        .iter()
        .flat_map(|(_, p)| events::decode_batch(p).unwrap().events)
        .filter(|e| matches!(e, KvEvent::BlockRemoved(_)))
        .count();
    assert!(removed > 0, "eviction emits BlockRemoved");
    let seqs: Vec<u64> = received.iter().chain(&later).map(|(s, _)| *s).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
}

#[test]
fn opaque_engine_hashes_and_positional_events_are_what_older_setups_publish() {
    let emu = EmuProcess::start(&["--engine-hash", "opaque", "--event-format", "positional"]);
    let sub = Events::subscribe(&emu.events);
    let mut received = Vec::new();
    let mut attempt = 0;
    wait_for("a first batch", || {
        attempt += 1;
        chat(
            &emu,
            json!({"messages": [user(&long_text(200, 5 + attempt))], "max_tokens": 2}),
        );
        received = sub.drain(Duration::from_millis(100));
        !received.is_empty()
    });
    let payload = &received[0].1;
    assert_eq!(payload[11], 0x9c, "a 12-element positional BlockStored");
    let batch = events::decode_batch(payload).unwrap();
    let KvEvent::BlockStored(stored) = &batch.events[0] else {
        panic!()
    };
    let keys = KeyConfig::new(HashAlgo::Sha256Cbor, 64, None, VllmCompat::V0_31).unwrap();
    let ours = keys.digests(&KeyExtras::default(), &stored.token_ids);
    assert_ne!(stored.block_hashes[0].block_key(), ours[0].block_key());
    let (_, metrics) = emu.get("/metrics");
    assert!(metrics.contains("prefix_caching_hash_algo=\"sha256\""));
}

#[test]
fn a_restart_starts_seq_at_zero_with_an_empty_cache() {
    let mut emu = EmuProcess::start(&[]);
    let messages = json!([user(&long_text(300, 6))]);
    chat(&emu, json!({"messages": messages, "max_tokens": 2}));
    assert!(cached(&chat(&emu, json!({"messages": messages, "max_tokens": 2}))) > 0);
    emu.restart();
    let sub = Events::subscribe(&emu.events);
    let mut received = Vec::new();
    // A new prompt each attempt: a cached one would publish nothing, and the subscription
    // may join after the first.
    let mut attempt = 0;
    wait_for("the restarted replica's events", || {
        attempt += 1;
        chat(
            &emu,
            json!({"messages": [user(&long_text(50, 99 + attempt))], "max_tokens": 2}),
        );
        received.extend(sub.drain(Duration::from_millis(100)));
        !received.is_empty()
    });
    assert_eq!(
        cached(&chat(&emu, json!({"messages": messages, "max_tokens": 2}))),
        0,
        "empty cache"
    );
    // Replay from 0 shows the new process's stream from its first batch.
    let context = zmq::Context::new();
    let dealer = context.socket(zmq::DEALER).unwrap();
    dealer.connect(emu.replay.as_deref().unwrap()).unwrap();
    dealer.send_multipart(events::replay_request(0), 0).unwrap();
    let first = dealer.recv_multipart(0).unwrap();
    match events::parse_replay(&first).unwrap() {
        events::ReplayMessage::Batch { seq, .. } => assert_eq!(seq, 0),
        events::ReplayMessage::End => panic!("nothing to replay"),
    }
}

#[test]
fn metrics_and_sources_say_what_a_router_needs() {
    let emu = EmuProcess::start(&["--block-size", "32", "--kv-events-topic", "kv"]);
    let (status, text) = emu.get("/metrics");
    assert_eq!(status, 200);
    for series in [
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
        "vllm:prefix_cache_queries_total{",
        "vllm:prefix_cache_hits_total{",
        "block_size=\"32\"",
        "prefix_caching_hash_algo=\"sha256_cbor\"",
        "model_name=\"emu-model\"",
    ] {
        assert!(text.contains(series), "{series} missing from\n{text}");
    }
    let (_, sources) = emu.get("/kv_event_sources");
    let sources: Value = serde_json::from_str(&sources).unwrap();
    assert_eq!(sources["0"]["endpoint"], emu.events.as_str());
    assert_eq!(sources["0"]["topic"], "kv");
    let (status, models) = emu.get("/v1/models");
    assert_eq!(status, 200);
    assert!(models.contains("emu-model"));
    assert_eq!(emu.get("/health").0, 200);
    assert_eq!(emu.post("/reset_prefix_cache", &json!({})).0, 200);
}

#[test]
fn responses_are_rendered_as_vllm_converts_them_and_stream_as_sse() {
    let emu = EmuProcess::start(&["--enable-responses-store"]);
    let body =
        json!({"instructions": "be brief", "input": long_text(200, 7), "max_output_tokens": 16});
    let (status, first) = emu.post("/v1/responses", &body);
    assert_eq!(status, 200, "{first}");
    // The same conversation as a chat request tokenizes to the same prompt.
    let as_chat =
        json!({"messages": [{"role": "system", "content": "be brief"}, user(&long_text(200, 7))]});
    let (_, tokenized) = emu.post("/tokenize", &as_chat);
    assert_eq!(first["usage"]["input_tokens"], tokenized["count"]);
    // vLLM drops the previous response's system messages: clients send instructions again.
    let follow = json!({"previous_response_id": first["id"], "instructions": "be brief",
                        "input": "more", "max_output_tokens": 8});
    let (status, second) = emu.post("/v1/responses", &follow);
    assert_eq!(status, 200, "{second}");
    assert!(
        second["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    let (status, _) = emu.post(
        "/v1/responses",
        &json!({"previous_response_id": "resp-nope", "input": "x"}),
    );
    assert_eq!(status, 404);
    let (status, text) = vllm_emu::harness::http(
        &emu.http,
        "POST",
        "/v1/chat/completions",
        &json!({"messages": [user("hi")], "stream": true, "max_tokens": 6}).to_string(),
    );
    assert_eq!(status, 200);
    assert!(text.starts_with("data: {"));
    assert!(text.trim_end().ends_with("data: [DONE]"));
}

#[test]
fn a_reset_is_published_with_the_next_step_as_vllm_publishes_it() {
    let emu = EmuProcess::start(&["--time-scale", "0"]);
    let sub = Events::subscribe(&emu.events);
    let decoded = |batches: Vec<(u64, Vec<u8>)>| -> Vec<KvEvent> {
        batches
            .iter()
            .flat_map(|(_, p)| events::decode_batch(p).unwrap().events)
            .collect()
    };
    let mut stored = Vec::new();
    let mut attempt = 0;
    wait_for("the first prompt's stores", || {
        attempt += 1;
        chat(
            &emu,
            json!({"messages": [user(&long_text(100, 7 + attempt))], "max_tokens": 2}),
        );
        stored.extend(decoded(sub.drain(Duration::from_millis(100))));
        stored.iter().any(|e| matches!(e, KvEvent::BlockStored(_)))
    });
    assert_eq!(emu.post("/reset_prefix_cache", &json!({})).0, 200);
    let idle = decoded(sub.drain(Duration::from_millis(300)));
    assert!(
        !idle.iter().any(|e| matches!(e, KvEvent::AllBlocksCleared)),
        "published before any step: {idle:?}"
    );
    chat(&emu, json!({"messages": [user("a")], "max_tokens": 1}));
    let mut after = Vec::new();
    wait_for("the reset, with the next step", || {
        after.extend(decoded(sub.drain(Duration::from_millis(100))));
        after.iter().any(|e| matches!(e, KvEvent::AllBlocksCleared))
    });
}

#[test]
fn dropped_batches_never_arrive_live_but_replay_has_them() {
    let emu = EmuProcess::start(&["--event-drop-rate", "1"]);
    let sub = Events::subscribe(&emu.events);
    for n in 0..3 {
        chat(
            &emu,
            json!({"messages": [user(&long_text(100, 40 + n))], "max_tokens": 2}),
        );
    }
    assert!(sub.drain(Duration::from_millis(200)).is_empty());
    let context = zmq::Context::new();
    let dealer = context.socket(zmq::DEALER).unwrap();
    dealer.connect(emu.replay.as_deref().unwrap()).unwrap();
    dealer.send_multipart(events::replay_request(0), 0).unwrap();
    let mut seqs = Vec::new();
    loop {
        let frames = dealer.recv_multipart(0).unwrap();
        match events::parse_replay(&frames).unwrap() {
            events::ReplayMessage::Batch { seq, .. } => seqs.push(seq),
            events::ReplayMessage::End => break,
        }
    }
    assert!(seqs.len() >= 3 && seqs[0] == 0, "{seqs:?}");
}

#[test]
fn render_endpoints_answer_the_tokens_tokenize_gives() {
    let replica = EmuProcess::start(&["--time-scale", "0"]);
    let chat = json!({"messages": [{"role": "user", "content": "render me"}],
                      "max_tokens": 5, "cache_salt": "tenant-a"});
    let (_, tokenized) = replica.post("/tokenize", &chat);
    let (status, rendered) = replica.post("/v1/chat/completions/render", &chat);
    assert_eq!(status, 200, "{rendered}");
    assert_eq!(rendered["token_ids"], tokenized["tokens"]);
    assert_eq!(rendered["cache_salt"], "tenant-a");
    assert_eq!(rendered["sampling_params"]["max_tokens"], 5);
    let completion = json!({"prompt": "once upon a time", "max_tokens": 3});
    let (_, tokenized) = replica.post("/tokenize", &completion);
    let (status, rendered) = replica.post("/v1/completions/render", &completion);
    assert_eq!(status, 200, "{rendered}");
    assert_eq!(rendered["token_ids"], tokenized["tokens"]);
    let (status, _) = replica.post("/v1/completions/render", &json!({"prompt": 7}));
    assert_eq!(status, 400);
}

#[test]
fn an_unknown_path_answers_404_and_keeps_the_connection() {
    use std::io::{Read, Write};
    let replica = EmuProcess::start(&["--time-scale", "0"]);
    let mut stream = std::net::TcpStream::connect(&replica.http).unwrap();
    let body = "x".repeat(100_000);
    let requests = format!(
        "POST /v1/nowhere HTTP/1.1\r\nhost: emu\r\ncontent-length: {}\r\n\r\n{body}\
         GET /health HTTP/1.1\r\nhost: emu\r\nconnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(requests.as_bytes()).unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let statuses: Vec<&str> = answer
        .match_indices("HTTP/1.1 ")
        .filter_map(|(at, _)| answer.get(at + 9..at + 12))
        .collect();
    assert_eq!(statuses, ["404", "200"], "{answer}");
}

#[test]
fn a_turn_over_budget_stops_at_exactly_max_tokens() {
    let replica = EmuProcess::start(&["--time-scale", "0"]);
    for max_tokens in [1, 4, 7, 12, 20] {
        for thinking in [true, false] {
            let (status, reply) = replica.post(
                "/v1/chat/completions",
                &json!({"messages": [{"role": "user", "content": "think hard"}],
                        "max_tokens": max_tokens,
                        "chat_template_kwargs": {"enable_thinking": thinking}}),
            );
            assert_eq!(status, 200, "{reply}");
            let used = reply["usage"]["completion_tokens"].as_u64().unwrap();
            match reply["choices"][0]["finish_reason"].as_str() {
                Some("length") => assert_eq!(used, max_tokens, "{reply}"),
                Some("stop") => assert!(used < max_tokens, "{reply}"),
                other => panic!("finish_reason {other:?}"),
            }
            if max_tokens == 1 || thinking && max_tokens < 12 {
                assert_eq!(reply["choices"][0]["finish_reason"], "length", "{reply}");
            }
        }
    }
    let (_, reply) = replica.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "think hard"}], "max_tokens": 200}),
    );
    assert_eq!(reply["choices"][0]["finish_reason"], "stop");
    assert!(reply["usage"]["completion_tokens"].as_u64().unwrap() < 200);
}
