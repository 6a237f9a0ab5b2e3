//! Did the prediction come true: the prompt tokens a replica says it served from its KV
//! cache, read from its answer (never changing it), and the outcome the filter reports.
//!
//! vLLM reports cached tokens in `usage.prompt_tokens_details.cached_tokens` (chat,
//! completions; only with `--enable-prompt-tokens-details`) and in
//! `usage.input_tokens_details.cached_tokens` (Responses), in a non-streamed body or in a
//! stream's last usage event (`stream_options.include_usage`, or Responses'
//! `response.completed`). An answer without them is unmeasured, not a miss.

use serde::{Deserialize, Serialize};

use crate::api::Api;

/// Where the daemon takes outcomes.
pub const OUTCOMES_PATH: &str = "/v1/outcomes";

/// What a replica reported of a request's prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt tokens in all.
    pub prompt_tokens: u64,
    /// Of those, served from its KV cache.
    pub cached_tokens: u64,
}

#[derive(Deserialize)]
struct Details {
    cached_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct RawUsage {
    prompt_tokens: Option<u64>,
    prompt_tokens_details: Option<Details>,
    input_tokens: Option<u64>,
    input_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct WithUsage {
    usage: Option<RawUsage>,
    /// A Responses stream event wraps the response.
    response: Option<Box<WithUsage>>,
}

impl RawUsage {
    fn read(self, api: Api) -> Option<Usage> {
        let (prompt, details) = match api {
            Api::Responses => (self.input_tokens, self.input_tokens_details),
            Api::ChatCompletions | Api::Completions => {
                (self.prompt_tokens, self.prompt_tokens_details)
            }
        };
        Some(Usage {
            prompt_tokens: prompt?,
            cached_tokens: details?.cached_tokens?,
        })
    }
}

fn usage_in(api: Api, json: &[u8]) -> Option<Usage> {
    let mut value: WithUsage = serde_json::from_slice(json).ok()?;
    if let Some(inner) = value.response.take() {
        value = *inner;
    }
    value.usage?.read(api)
}

/// The usage of a whole non-streamed answer body.
pub fn usage_of(api: Api, body: &[u8]) -> Option<Usage> {
    usage_in(api, body)
}

/// Follows a streamed answer (server-sent events) chunk by chunk, keeping only the line in
/// progress, and remembers the last usage it carried.
#[derive(Debug)]
pub struct StreamUsage {
    api: Api,
    line: Vec<u8>,
    max_line_bytes: usize,
    /// The line in progress outgrew `max_line_bytes`: skipped up to its end.
    skipping: bool,
    last: Option<Usage>,
}

impl StreamUsage {
    /// Lines longer than `max_line_bytes` (a Responses `response.completed` event carries
    /// the whole response) are not read.
    pub fn new(api: Api, max_line_bytes: usize) -> Self {
        Self {
            api,
            line: Vec::new(),
            max_line_bytes,
            skipping: false,
            last: None,
        }
    }

    /// Reads the next chunk of the stream, as it passes.
    pub fn feed(&mut self, mut chunk: &[u8]) {
        while !chunk.is_empty() {
            let (piece, rest, ended) = match chunk.iter().position(|b| *b == b'\n') {
                Some(at) => (chunk.get(..at), chunk.get(at + 1..), true),
                None => (Some(chunk), None, false),
            };
            let piece = piece.unwrap_or_default();
            chunk = rest.unwrap_or_default();
            if !self.skipping {
                if self.line.len() + piece.len() > self.max_line_bytes {
                    self.skipping = true;
                    self.line.clear();
                } else {
                    self.line.extend_from_slice(piece);
                }
            }
            if ended {
                if !self.skipping {
                    self.line_ended();
                }
                self.line.clear();
                self.skipping = false;
            }
        }
    }

    fn line_ended(&mut self) {
        let line = self.line.strip_suffix(b"\r").unwrap_or(&self.line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        // Most events are tokens: only one that names cached tokens is parsed.
        if !data.windows(13).any(|w| w == b"cached_tokens") {
            return;
        }
        if let Some(usage) = usage_in(self.api, data) {
            self.last = Some(usage);
        }
    }

    /// The last usage the stream carried (a final line without its newline included).
    pub fn finish(mut self) -> Option<Usage> {
        if !self.skipping && !self.line.is_empty() {
            self.line_ended();
        }
        self.last
    }
}

/// One routed request's prediction and what its replica reported, as the filter sends it
/// to the daemon (`POST /v1/outcomes`, in batches).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    /// The replica the request was pinned to (`host:port`).
    pub endpoint: String,
    /// The body's `model`, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The routing reason (`prefix`, `load`, ...).
    pub reason: String,
    /// The mode it was routed in (`precise`, `approximate`, ...).
    pub mode: String,
    /// Matched blocks times the block size: what the router expected to be served cached.
    pub predicted_tokens: u64,
    /// What the replica reported it served from cache.
    pub cached_tokens: u64,
    /// The prompt's length, as the replica counted it.
    pub prompt_tokens: u64,
}

/// A batch of outcomes: the body of `POST /v1/outcomes`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcomes {
    /// Oldest first.
    pub outcomes: Vec<Outcome>,
}

impl Outcomes {
    /// The request body.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHAT: &[u8] = br#"{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":40,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":32}}}"#;

    #[test]
    fn non_streamed_bodies_give_their_usage() {
        let want = Usage {
            prompt_tokens: 40,
            cached_tokens: 32,
        };
        assert_eq!(usage_of(Api::ChatCompletions, CHAT), Some(want));
        assert_eq!(usage_of(Api::Completions, CHAT), Some(want));
        let responses = br#"{"id":"r","output":[],"usage":{"input_tokens":40,"input_tokens_details":{"cached_tokens":32},"output_tokens":1}}"#;
        assert_eq!(usage_of(Api::Responses, responses), Some(want));
        // The other API's field names are not read as this one's.
        assert_eq!(usage_of(Api::Responses, CHAT), None);
    }

    #[test]
    fn answers_without_cached_tokens_are_unmeasured() {
        for body in [
            &br#"{"usage":{"prompt_tokens":40}}"#[..],
            br#"{"usage":{"prompt_tokens":40,"prompt_tokens_details":null}}"#,
            br#"{"usage":null}"#,
            br#"{"error":{"message":"bad"}}"#,
            b"not json",
            b"",
        ] {
            assert_eq!(usage_of(Api::ChatCompletions, body), None);
        }
    }

    fn stream(api: Api, text: &[u8], piece: usize, max: usize) -> Option<Usage> {
        let mut usage = StreamUsage::new(api, max);
        for chunk in text.chunks(piece) {
            usage.feed(chunk);
        }
        usage.finish()
    }

    #[test]
    fn a_streams_last_usage_is_found_however_it_is_cut() {
        let text = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n\
            data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\r\n\r\n\
            data: [DONE]\n\n";
        for piece in 1..text.len() {
            assert_eq!(
                stream(Api::ChatCompletions, text, piece, 4096),
                Some(Usage {
                    prompt_tokens: 40,
                    cached_tokens: 32
                }),
                "{piece}"
            );
        }
        let responses = b"event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":9,\"input_tokens_details\":{\"cached_tokens\":0}}}}";
        assert_eq!(
            stream(Api::Responses, responses, 7, 4096),
            Some(Usage {
                prompt_tokens: 9,
                cached_tokens: 0
            })
        );
        // Too long a line is skipped, and the lines after it are still read.
        let long = [
            &b"data: {\"cached_tokens\":"[..],
            &[b'1'; 100],
            b"}\n",
            text,
        ]
        .concat();
        assert_eq!(
            stream(Api::ChatCompletions, &long, 16, 110),
            Some(Usage {
                prompt_tokens: 40,
                cached_tokens: 32
            })
        );
        assert_eq!(stream(Api::ChatCompletions, text, 16, 64), None);
    }

    #[test]
    fn outcomes_round_trip() {
        let batch = Outcomes {
            outcomes: vec![Outcome {
                endpoint: "127.0.0.1:8000".into(),
                model: None,
                reason: "prefix".into(),
                mode: "precise".into(),
                predicted_tokens: 32,
                cached_tokens: 32,
                prompt_tokens: 40,
            }],
        };
        let back: Outcomes = serde_json::from_slice(&batch.to_json()).unwrap();
        assert_eq!(back, batch);
    }
}
