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
    parse_response(&raw)
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

/// A response read off the wire (a cut one too: status and headers, and the body as far as
/// it came).
pub fn parse_response(raw: &[u8]) -> Reply {
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

/// One kept-alive HTTP/1.1 connection: requests sent on it reach one Envoy worker, whose
/// round robin then alternates strictly between replicas (a deterministic control).
pub struct Connection {
    reader: std::io::BufReader<TcpStream>,
}

impl Connection {
    /// Connects to `addr`.
    pub fn open(addr: &str) -> std::io::Result<Self> {
        let stream = TcpStream::connect(addr)?;
        stream.set_read_timeout(Some(Duration::from_secs(120)))?;
        Ok(Self {
            reader: std::io::BufReader::new(stream),
        })
    }

    /// POSTs JSON to `path` and reads the whole response, keeping the connection.
    pub fn post_json(&mut self, path: &str, body: &Value) -> Reply {
        use std::io::BufRead;
        let body = body.to_string();
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: gateway\r\ncontent-type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        if self.reader.get_mut().write_all(request.as_bytes()).is_err() {
            return failed();
        }
        let mut head = Vec::new();
        loop {
            let mut line = String::new();
            match self.reader.read_line(&mut line) {
                Ok(0) | Err(_) => return failed(),
                Ok(_) if line == "\r\n" => break,
                Ok(_) => head.push(line.trim_end().to_owned()),
            }
        }
        let mut raw = head.join("\r\n").into_bytes();
        raw.extend_from_slice(b"\r\n\r\n");
        let field = |name: &str| {
            head.iter().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.trim()
                    .eq_ignore_ascii_case(name)
                    .then(|| v.trim().to_owned())
            })
        };
        if let Some(length) = field("content-length").and_then(|v| v.parse::<usize>().ok()) {
            let mut body = vec![0; length];
            if self.reader.read_exact(&mut body).is_err() {
                return failed();
            }
            raw.extend_from_slice(&body);
        } else if field("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
            loop {
                let mut size = String::new();
                if self.reader.read_line(&mut size).is_err() {
                    return failed();
                }
                raw.extend_from_slice(size.as_bytes());
                let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
                    return failed();
                };
                let mut chunk = vec![0; n + 2];
                if self.reader.read_exact(&mut chunk).is_err() {
                    return failed();
                }
                raw.extend_from_slice(&chunk);
                if n == 0 {
                    break;
                }
            }
        }
        parse_response(&raw)
    }
}
