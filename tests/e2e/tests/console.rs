//! kvaffined's console in a real browser (Debian's `chromium`, headless) against a running
//! stack: the page loads from the daemon with its assets, and its explain tool, opened by a
//! shared link (`/ui?explain=<body>`), shows the prefix a just-sent conversation left on its
//! replica, keyed in the browser by kvaffine's core built with wasm-bindgen. The numbers it
//! must show come from what the replica reported (its `usage`), not from kvaffine.

use std::process::Command;

use kvaffine_e2e::client::{Reply, post_json, send};
use kvaffine_e2e::{Stack, StackConfig, root};
use serde_json::json;

/// Runs headless Chromium on `url`; the DOM after the page's scripts ran, and a screenshot
/// at `screenshot`.
fn browse(url: &str, screenshot: &std::path::Path) -> String {
    let chromium = |extra: &[&str]| {
        let out = Command::new("chromium")
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--window-size=1280,1500",
                // Virtual time runs only while no fetch is pending: the page's calls finish
                // before it is dumped.
                "--virtual-time-budget=10000",
            ])
            .args(extra)
            .arg(url)
            .output()
            .expect("Debian's chromium is installed (cargo xtask test installs it)");
        assert!(
            out.status.success(),
            "chromium failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    chromium(&[&format!("--screenshot={}", screenshot.display())]);
    chromium(&["--dump-dom"])
}

/// The value of attribute `name` on the element whose opening tag contains `marker`.
fn attribute(dom: &str, marker: &str, name: &str) -> Option<String> {
    let at = dom.find(marker)?;
    let start = dom.get(..at)?.rfind('<')?;
    let tag = dom.get(start..start + dom.get(start..)?.find('>')?)?;
    let value = tag.split(&format!("{name}=\"")).nth(1)?;
    Some(value.split('"').next()?.to_owned())
}

fn served_by(reply: &Reply) -> String {
    reply.header("x-served-by").unwrap_or("").to_owned()
}

#[test]
fn the_console_explains_the_prefix_a_conversation_left_on_its_replica() {
    let stack = Stack::start(StackConfig::default()).unwrap();
    let block = StackConfig::default().block_size as u64;
    let text: String = (0..500)
        .map(|i| format!("w{} ", (i * 7919) % 4999))
        .collect();
    let mut body = json!({
        "model": "emu-model",
        "messages": [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": text}],
        "max_tokens": 4,
        "cache_salt": "console",
    });
    let first = post_json(&stack.gateway, "/v1/chat/completions", &body);
    assert_eq!(first.status, 200, "{}", first.body);
    let messages = body["messages"].as_array_mut().unwrap();
    messages.push(first.json()["choices"][0]["message"].clone());
    messages.push(json!({"role": "user", "content": "and then?"}));
    let second = post_json(&stack.gateway, "/v1/chat/completions", &body);
    assert_eq!(second.status, 200, "{}", second.body);
    let warm = served_by(&second);
    assert_eq!(warm, served_by(&first));
    let prompt = second.json()["usage"]["prompt_tokens"].as_u64().unwrap();

    // The page and its assets need no token and carry no data.
    let page = send(&stack.daemon_addr, "GET", "/ui", &[], b"");
    assert_eq!(page.status, 200);
    assert!(
        page.header("content-type")
            .unwrap_or("")
            .starts_with("text/html")
    );
    let wasm = send(
        &stack.daemon_addr,
        "GET",
        "/ui/keys/kvaffine_keys_bg.wasm",
        &[],
        b"",
    );
    assert_eq!(wasm.header("content-type"), Some("application/wasm"));
    // Another model's tokenizer would give other tokens: a model no replica serves is
    // refused, not explained with the wrong one.
    let other = json!({"body": {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}});
    let refused = send(
        &stack.daemon_addr,
        "POST",
        "/v1/explain",
        &[("content-type", "application/json")],
        other.to_string().as_bytes(),
    );
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert!(refused.body.contains("no-such-model"), "{}", refused.body);

    let url = format!(
        "http://{}/ui?explain={}",
        stack.daemon_addr,
        percent_encode(&body.to_string())
    );
    let shot = root().join("target/console");
    std::fs::create_dir_all(&shot).unwrap();
    let dom = browse(&url, &shot.join("console.png"));
    assert_eq!(
        attribute(&dom, "id=\"explain-result\"", "data-state").as_deref(),
        Some("done"),
        "the explain tool finished: {}",
        excerpt(&dom, "explain-result")
    );
    // The tokens the page keyed are the prompt the replica reported.
    assert_eq!(
        attribute(&dom, "id=\"explain-summary\"", "data-tokens"),
        Some(prompt.to_string())
    );
    let blocks = prompt / block;
    assert_eq!(
        attribute(&dom, "id=\"explain-summary\"", "data-blocks"),
        Some(blocks.to_string())
    );
    // Every full block of turn 2's prompt is on the replica that computed it; the other
    // holds none of this salt's blocks.
    for replica in stack.replica_addresses() {
        let held = attribute(
            &dom,
            &format!("data-endpoint=\"{replica}\" data-leading-blocks"),
            "data-leading-blocks",
        );
        let want = if replica == warm { blocks } else { 0 };
        assert_eq!(
            held,
            Some(want.to_string()),
            "{replica}: {}",
            excerpt(&dom, "explain-table")
        );
    }
    // The replica table and the decisions the filter reported are on the page too.
    assert!(dom.contains(&format!("<tr data-endpoint=\"{warm}\"><td>{warm}</td>")));
    assert!(
        dom.contains("<td>prefix</td>"),
        "{}",
        excerpt(&dom, "decisions")
    );
    let png = std::fs::read(shot.join("console.png")).unwrap();
    assert!(png.starts_with(b"\x89PNG"), "a screenshot");
}

/// Behind `--auth-token-file`, the page still loads (it holds no data) but every data call
/// needs the token: without one the page says so; with the token in the URL fragment
/// (never sent to a server) the same link explains.
#[test]
fn behind_a_token_the_console_needs_the_token() {
    let dir = root().join("target/console/auth");
    std::fs::create_dir_all(&dir).unwrap();
    let tokens = dir.join("tokens");
    std::fs::write(&tokens, "console-token\n").unwrap();
    let stack = Stack::start(StackConfig {
        daemon_args: vec!["--auth-token-file".into(), tokens.display().to_string()],
        filter: json!({"index_token": "console-token"}),
        ..StackConfig::default()
    })
    .unwrap();
    assert_eq!(send(&stack.daemon_addr, "GET", "/ui", &[], b"").status, 200);
    assert_eq!(
        send(&stack.daemon_addr, "POST", "/v1/explain", &[], b"{}").status,
        401
    );
    let body =
        json!({"messages": [{"role": "user", "content": "w1 w2 w3 ".repeat(40)}], "max_tokens": 2});
    let url = format!(
        "http://{}/ui?explain={}",
        stack.daemon_addr,
        percent_encode(&body.to_string())
    );
    let refused = browse(&url, &dir.join("refused.png"));
    assert_eq!(
        attribute(&refused, "id=\"explain-result\"", "data-state").as_deref(),
        Some("failed")
    );
    assert!(
        refused.contains("needs a token"),
        "{}",
        excerpt(&refused, "explain-result")
    );
    let allowed = browse(
        &format!("{url}#token=console-token"),
        &dir.join("allowed.png"),
    );
    assert_eq!(
        attribute(&allowed, "id=\"explain-result\"", "data-state").as_deref(),
        Some("done"),
        "{}",
        excerpt(&allowed, "explain-result")
    );
}

fn excerpt(dom: &str, marker: &str) -> String {
    let at = dom.find(marker).unwrap_or(0);
    dom.chars().skip(at).take(1500).collect()
}

fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect()
}
