//! A plain HTTP/1.1 client that keeps response headers, for driving the gateway the way a
//! curl user would (one connection per request, `Connection: close`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::Value;
use vllm_emu::harness::dechunk;

/// A response.
pub struct Reply {
    /// Status code (0 if the exchange failed).
    pub status: u16,
    /// Headers in order.
    pub headers: Vec<(String, String)>,
    /// Body, de-chunked.
    pub body: String,
}

impl Reply {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON (`Null` if it is not).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
}

fn failed() -> Reply {
    Reply {
        status: 0,
        headers: Vec::new(),
        body: String::new(),
    }
}

/// Sends one request with `headers` and `body`.
pub fn send(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    let Ok(mut stream) = TcpStream::connect(addr) else {
        return failed();
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(120)));
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    if stream.write_all(head.as_bytes()).is_err() || stream.write_all(body).is_err() {
        return failed();
    }
    send_raw_response(stream)
}

/// Sends bytes as they are (a hand-made request) and reads the response.
pub fn send_raw(addr: &str, request: &[u8]) -> Reply {
    let Ok(mut stream) = TcpStream::connect(addr) else {
        return failed();
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(120)));
    if stream.write_all(request).is_err() {
        return failed();
    }
    send_raw_response(stream)
}

fn send_raw_response(mut stream: TcpStream) -> Reply {
    let mut raw = Vec::new();
    if stream.read_to_end(&mut raw).is_err() {
        return failed();
    }
    parse(&raw)
}

/// POSTs JSON to `path`.
pub fn post_json(addr: &str, path: &str, body: &Value) -> Reply {
    send(
        addr,
        "POST",
        path,
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
    )
}

fn parse(raw: &[u8]) -> Reply {
    let text = String::from_utf8_lossy(raw).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_owned()
    };
    Reply {
        status,
        headers,
        body,
    }
}
