//! The lookup protocol between the filter and `kvaffined`: one set of types both sides
//! serialize, so they agree by construction rather than by string keys.
//!
//! Protocol 2 is `POST /v2/lookup`: block keys or text keys (distinct types), and an
//! answer of the top candidates only. Protocol 1 (`POST /v1/lookup`, [`v1`]) stays on both
//! sides, so a filter and a daemon one release apart still route: a protocol-2 filter
//! falls back to it when a daemon answers `/v2/lookup` with 404, and a protocol-2 daemon
//! keeps answering it. Rule for changes: a new answer field is free (readers ignore what
//! they do not know); a new request field needs a new protocol path, because daemons
//! refuse request fields they do not know.

use serde::{Deserialize, Serialize};

use crate::approximate::TextKey;
use crate::config::{Router, RoutingConfig};
use crate::keys::{BlockKey, KeyExtras, LoraAdapter};
use crate::reason::Reason;
use crate::salt::CacheSalt;

/// Where protocol-2 lookups go.
pub const LOOKUP_PATH: &str = "/v2/lookup";

/// What to match.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Query {
    /// vLLM's block keys, block 0 first, matched against KV events. None: rank by load.
    Blocks(Vec<BlockKey>),
    /// Text keys (the approximate mode), matched against where earlier requests went.
    Text(Vec<TextKey>),
}

impl Query {
    /// Keys in the request.
    pub fn len(&self) -> usize {
        match self {
            Self::Blocks(keys) => keys.len(),
            Self::Text(keys) => keys.len(),
        }
    }

    /// Whether there are no keys (a load-only lookup).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Asks the daemon to remember the pick until the replica's events confirm it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Booking {
    /// Lifetime in milliseconds (default: the daemon's `--booking-ttl-ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
}

/// A protocol-2 lookup.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RequestWire", into = "RequestWire")]
pub struct LookupRequest {
    /// The keys.
    pub query: Query,
    /// Only replicas serving this model (or not yet known to serve another) are ranked.
    pub model: Option<String>,
    /// Book the first-ranked replica for these keys.
    pub book: Option<Booking>,
    /// How many ranked candidates to answer (the pick and its fallbacks), at least 1.
    pub candidates: usize,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestWire {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    blocks: Option<Vec<BlockKey>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    text: Option<Vec<TextKey>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    book: Option<Booking>,
    #[serde(default = "one")]
    candidates: usize,
}

fn one() -> usize {
    1
}

impl TryFrom<RequestWire> for LookupRequest {
    type Error = &'static str;

    fn try_from(wire: RequestWire) -> Result<Self, Self::Error> {
        let query = match (wire.blocks, wire.text) {
            (Some(blocks), None) => Query::Blocks(blocks),
            (None, Some(text)) => Query::Text(text),
            _ => return Err("a lookup has exactly one of `blocks` and `text`"),
        };
        if wire.candidates == 0 {
            return Err("`candidates` must be at least 1");
        }
        Ok(Self {
            query,
            model: wire.model,
            book: wire.book,
            candidates: wire.candidates,
        })
    }
}

impl From<LookupRequest> for RequestWire {
    fn from(request: LookupRequest) -> Self {
        let (blocks, text) = match request.query {
            Query::Blocks(keys) => (Some(keys), None),
            Query::Text(keys) => (None, Some(keys)),
        };
        Self {
            blocks,
            text,
            model: request.model,
            book: request.book,
            candidates: request.candidates,
        }
    }
}

impl LookupRequest {
    /// The JSON body.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// One ranked candidate.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Candidate {
    /// `HOST:PORT`, as the gateway's upstream knows it.
    pub endpoint: String,
    /// Leading blocks its events confirm it holds. A booked prefix is left out: until its
    /// prefill is done vLLM cannot serve it, so a sibling sent meanwhile is still steered
    /// to it but predicted no more than this.
    pub matched_blocks: u32,
}

/// A protocol-2 answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupAnswer {
    /// The best candidates, best first, at most as many as asked for.
    pub candidates: Vec<Candidate>,
    /// Why the first is first.
    pub reason: Reason,
    /// Every replica's index is known to be complete.
    #[serde(default = "yes")]
    pub complete: bool,
    /// The replica booked, when booking was asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub booked: Option<String>,
    /// Where the next tokenizer callout for this model is cheapest: the replica a request
    /// with nothing cached would be ranked first at, the least busy by the daemon's view
    /// of load (the gateway's own balancer on the tokenizer cluster sees only tokenizer
    /// calls). Absent when no replica is usable, and from daemons before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenize_at: Option<String>,
}

fn yes() -> bool {
    true
}

/// Why a lookup answer is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    /// Not the daemon's JSON.
    #[error("the index's answer is not a lookup response")]
    Malformed,
    /// No endpoint to pick.
    #[error("the index knows no endpoint for this request")]
    Empty,
}

/// Reads a protocol-2 answer.
pub fn read_answer(bytes: &[u8]) -> Result<LookupAnswer, LookupError> {
    serde_json::from_slice(bytes).map_err(|_| LookupError::Malformed)
}

/// Where salt probes go (a path of its own: daemons before it answer 404, and the filter
/// then tokenizes as it always did).
pub const SALT_PATH: &str = "/v2/salt";

/// Asked before a salted request pays for a tokenizer call: the salt is keyed into block
/// 0, so when no replica holds a first block of it (by its KV events) and none is booked
/// for it, no cached prefix can match, and the request is routed by load at once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SaltProbe {
    /// The salt's tag ([`crate::CacheSalt::tag`]).
    pub salt: u64,
    /// Only replicas serving this model (or not yet known to serve another) count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Book the pick for the salt when the request is routed here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub book: Option<Booking>,
    /// How many ranked candidates to answer, at least 1.
    #[serde(default = "one")]
    pub candidates: usize,
    /// The prompt's tokens as the filter estimates them from its size
    /// ([`crate::tokens::TokensPerByte`]): what a pick queues on its replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// The request's text keys, seeded by its template inputs
    /// ([`crate::plan::probe_text_keys`]). A salt's first request is routed before its
    /// tokens are known, so its blocks cannot be booked: its text keys are, and a later
    /// request of the salt, arriving before the replica's events show the salt, follows it
    /// as far as their texts and templates agree, not further. Load accounting only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<Vec<TextKey>>,
}

impl SaltProbe {
    /// The JSON body.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// The answer to a [`SaltProbe`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SaltAnswer {
    /// The request routed without tokenizing, its reason saying why. Absent when some
    /// replica may hold the salt (or the daemon cannot tell): the filter tokenizes and
    /// looks up as usual.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<LookupAnswer>,
    /// As [`LookupAnswer::tokenize_at`], for the tokenizer call that follows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenize_at: Option<String>,
}

/// Reads a [`SaltAnswer`].
pub fn read_salt_answer(bytes: &[u8]) -> Result<SaltAnswer, LookupError> {
    serde_json::from_slice(bytes).map_err(|_| LookupError::Malformed)
}

/// Where a filter hands the index a request's tokenizer call, to make it, key its answer
/// and look up in one callout (a path of its own: daemons before it answer 404, and the
/// filter then calls the tokenizer itself). One callout instead of two saves the gateway a
/// round of its callout machinery and the token list a copy into the filter's VM.
pub const ROUTE_PATH: &str = "/v2/route";

/// What a request's keys are made with: the settings that must match the replicas' (the
/// filter's, so that both ways of keying agree) and the request's own extras.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeySettings {
    /// vLLM's `--block-size`.
    pub block_size: usize,
    /// vLLM's `--prefix-caching-hash-algo`.
    pub hash_algo: String,
    /// The replicas' `PYTHONHASHSEED`, if set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash_seed: Option<String>,
    /// The extra-key encoding (`0.31` or `0.30`).
    pub vllm_compat: String,
    /// The request's `cache_salt`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
    /// The request's LoRA adapter: its name and its path as the replicas loaded it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<(String, String)>,
}

impl KeySettings {
    /// The settings of `router` with a request's `extras`.
    pub fn of(router: &Router, extras: &KeyExtras) -> Self {
        let config = &router.config;
        Self {
            block_size: config.block_size,
            hash_algo: config.hash_algo.clone(),
            hash_seed: config.hash_seed.clone(),
            vllm_compat: config.vllm_compat.clone(),
            cache_salt: extras.cache_salt.as_ref().map(|s| s.as_str().to_owned()),
            lora: extras
                .lora
                .as_ref()
                .map(|l| (l.name.clone(), l.path.clone())),
        }
    }

    /// The router and extras these settings describe, validated as the filter validates
    /// its own.
    pub fn keying(&self) -> Result<(Router, KeyExtras), String> {
        let config: RoutingConfig = serde_json::from_value(serde_json::json!({
            "block_size": self.block_size,
            "hash_algo": self.hash_algo,
            "hash_seed": self.hash_seed,
            "vllm_compat": self.vllm_compat,
        }))
        .map_err(|e| e.to_string())?;
        let router = Router::new(config).map_err(|e| e.to_string())?;
        let cache_salt = self
            .cache_salt
            .as_deref()
            .map(CacheSalt::parse)
            .transpose()
            .map_err(|e| e.to_string())?;
        let lora = self.lora.as_ref().map(|(name, path)| LoraAdapter {
            name: name.clone(),
            path: path.clone(),
        });
        Ok((router, KeyExtras { lora, cache_salt }))
    }
}

/// A request's tokenizer call for the index to make ([`ROUTE_PATH`]). On the wire this is
/// one JSON line, then the tokenizer call's body exactly as the replica takes it, so the
/// body is neither escaped nor parsed on the way.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteRequest {
    /// The tokenizer path, one of [`crate::plan::TOKENIZER_PATHS`].
    pub path: String,
    /// How to key the tokens.
    pub keys: KeySettings,
    /// Only replicas serving this model (or not yet known to serve another) are ranked,
    /// and the tokenizer call goes to one of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Book the first-ranked replica for the keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub book: Option<Booking>,
    /// How many ranked candidates to answer, at least 1.
    #[serde(default = "one")]
    pub candidates: usize,
    /// Ask about the request's salt first: when no replica can hold it, the request is
    /// routed as the probe routes it, with no tokenizer call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe: Option<SaltProbe>,
    /// The filter's deadline for the whole callout, milliseconds: the tokenizer call gets
    /// what is left of it less a tenth, so its failure is answered before the filter
    /// gives up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

impl RouteRequest {
    /// The body: this request's JSON line, then the tokenizer call's body.
    pub fn to_body(&self, call: &[u8]) -> Vec<u8> {
        let mut body = serde_json::to_vec(self).unwrap_or_default();
        body.reserve(call.len() + 1);
        // JSON text carries newlines escaped, so the first one ends the line.
        body.push(b'\n');
        body.extend_from_slice(call);
        body
    }

    /// Splits a body into the request and its tokenizer call's body.
    pub fn read(body: &[u8]) -> Result<(Self, &[u8]), String> {
        let (line, call) = body
            .iter()
            .position(|&b| b == b'\n')
            .and_then(|split| Some((body.get(..split)?, body.get(split + 1..)?)))
            .ok_or("a route body is a JSON line, a newline, then the tokenizer call's body")?;
        let request: Self = serde_json::from_slice(line).map_err(|e| e.to_string())?;
        if request.candidates == 0 {
            return Err("`candidates` must be at least 1".into());
        }
        if !crate::plan::TOKENIZER_PATHS.contains(&request.path.as_str()) {
            return Err(format!("{:?} is not a tokenizer path", request.path));
        }
        Ok((request, call))
    }
}

/// The answer to a [`RouteRequest`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteAnswer {
    /// The lookup's answer, as `/v2/lookup` gives it (or the salt probe's route).
    pub route: LookupAnswer,
    /// The prompt's tokens, when it was tokenized; absent when the salt probe routed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// Where the tokenizer call went.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenized_at: Option<String>,
}

/// Reads a [`RouteAnswer`].
pub fn read_route_answer(bytes: &[u8]) -> Result<RouteAnswer, LookupError> {
    serde_json::from_slice(bytes).map_err(|_| LookupError::Malformed)
}

/// Salts whose requests the filter tokenizes without probing first: the daemon said a
/// replica holds them, so their next requests (continuations, mostly) would be told the
/// same. A bounded set, oldest out first; a salt that left every replica's cache since
/// costs one tokenizer call that finds nothing.
#[derive(Debug, Default)]
pub struct HeldSalts {
    order: std::collections::VecDeque<u64>,
    /// Ordered, not hashed: a std hash set seeds itself from the host's randomness when
    /// made, and the filter's root is made before its configuration checks that source.
    tags: std::collections::BTreeSet<u64>,
}

impl HeldSalts {
    /// Salts remembered; past it the oldest goes.
    pub const MAX_SALTS: usize = 4096;

    /// Notes that a replica holds `tag`.
    pub fn insert(&mut self, tag: u64) {
        if !self.tags.insert(tag) {
            return;
        }
        self.order.push_back(tag);
        if self.order.len() > Self::MAX_SALTS {
            if let Some(oldest) = self.order.pop_front() {
                self.tags.remove(&oldest);
            }
        }
    }

    /// Whether a replica was said to hold `tag`.
    pub fn contains(&self, tag: u64) -> bool {
        self.tags.contains(&tag)
    }
}

/// A pick: the endpoints to try in order, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pick {
    /// The pick first, then the ranked fallbacks.
    pub endpoints: Vec<String>,
    /// Blocks the pick's events confirm it holds.
    pub matched_blocks: u64,
    /// The daemon's reason.
    pub reason: Reason,
}

impl Pick {
    /// The pick and at most `fallbacks` more, skipping anything that is not `host:port`
    /// (a daemon's answer is never put into a header unchecked).
    pub fn from_answer(answer: &LookupAnswer, fallbacks: usize) -> Result<Self, LookupError> {
        let valid: Vec<&Candidate> = answer
            .candidates
            .iter()
            .filter(|c| valid_endpoint(&c.endpoint))
            .take(1 + fallbacks)
            .collect();
        let first = valid.first().ok_or(LookupError::Empty)?;
        Ok(Self {
            matched_blocks: u64::from(first.matched_blocks),
            endpoints: valid.iter().map(|c| c.endpoint.clone()).collect(),
            reason: answer.reason,
        })
    }

    /// The endpoint header value: comma-separated, as override_host reads it.
    pub fn header_value(&self) -> String {
        self.endpoints.join(",")
    }
}

/// Each model's latest tokenizer hint ([`LookupAnswer::tokenize_at`]): the filter sends a
/// tokenizer callout there before its own lookup says anything, so the hint comes from the
/// answers to earlier requests. A hint stays until a newer answer names another replica or
/// a callout to it fails: an old hint still names a replica that was usable, while without
/// one the gateway's balancer may pick a frozen replica (slow traffic, a request every few
/// seconds, would otherwise lose the hint between requests).
#[derive(Debug, Default)]
pub struct TokenizerHints {
    /// (model, endpoint, order noted), at most [`Self::MAX_MODELS`].
    hints: Vec<(Option<String>, String, u64)>,
    noted: u64,
}

impl TokenizerHints {
    /// Models remembered; past it the least recently noted hint goes.
    pub const MAX_MODELS: usize = 64;

    /// Notes an answer's hint for `model`. An answer without one (an older daemon, or no
    /// replica usable at that moment: a busy replica's scrape can time out) leaves the
    /// model's last hint: the replica it names was the least busy a moment ago, while the
    /// gateway's own balancer may pick a frozen one.
    pub fn note(&mut self, model: Option<&str>, tokenize_at: Option<&str>) {
        let Some(endpoint) = tokenize_at.filter(|e| valid_endpoint(e)) else {
            return;
        };
        self.noted += 1;
        if let Some(hint) = self.hints.iter_mut().find(|(m, ..)| m.as_deref() == model) {
            endpoint.clone_into(&mut hint.1);
            hint.2 = self.noted;
            return;
        }
        if self.hints.len() >= Self::MAX_MODELS {
            let oldest = self.hints.iter().enumerate().min_by_key(|(_, h)| h.2);
            if let Some(i) = oldest.map(|(i, _)| i) {
                self.hints.swap_remove(i);
            }
        }
        self.hints
            .push((model.map(str::to_owned), endpoint.to_owned(), self.noted));
    }

    /// The endpoint to tokenize `model`'s next request at, if a hint names one.
    pub fn get(&self, model: Option<&str>) -> Option<&str> {
        self.hints
            .iter()
            .find(|(m, ..)| m.as_deref() == model)
            .map(|(_, endpoint, _)| endpoint.as_str())
    }

    /// A tokenizer callout to `endpoint` failed or timed out: `model`'s hint goes if it
    /// still names that endpoint, and the gateway's balancer chooses until the next answer.
    pub fn forget(&mut self, model: Option<&str>, endpoint: &str) {
        self.hints
            .retain(|(m, e, _)| !(m.as_deref() == model && e == endpoint));
    }
}

fn valid_endpoint(endpoint: &str) -> bool {
    endpoint
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
        && endpoint
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-:[]_".contains(&b))
}

/// Protocol 1: `POST /v1/lookup`, every endpoint's full record in each answer.
pub mod v1 {
    use serde::{Deserialize, Serialize};

    use super::{Booking, Candidate, LookupAnswer, LookupError, LookupRequest, Query};
    use crate::approximate::TextKey;
    use crate::keys::BlockKey;
    use crate::reason::Reason;

    /// Where protocol-1 lookups go.
    pub const LOOKUP_PATH: &str = "/v1/lookup";

    /// A protocol-1 lookup: keys of either kind, told apart by a flag.
    #[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Request {
        /// Block keys, or text keys when `approximate`.
        pub keys: Vec<u64>,
        /// As in protocol 2.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub model: Option<String>,
        /// As in protocol 2.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub book: Option<Booking>,
        /// The keys are text keys.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        pub approximate: bool,
    }

    impl From<&LookupRequest> for Request {
        fn from(request: &LookupRequest) -> Self {
            let (keys, approximate) = match &request.query {
                Query::Blocks(keys) => (keys.iter().map(|k| k.0).collect(), false),
                Query::Text(keys) => (keys.iter().map(|k| k.0).collect(), true),
            };
            Self {
                keys,
                model: request.model.clone(),
                book: request.book,
                approximate,
            }
        }
    }

    impl Request {
        /// The same lookup in protocol 2, asking for every candidate (protocol 1 answers
        /// them all).
        pub fn into_current(self) -> LookupRequest {
            let query = if self.approximate {
                Query::Text(self.keys.into_iter().map(TextKey).collect())
            } else {
                Query::Blocks(self.keys.into_iter().map(BlockKey).collect())
            };
            LookupRequest {
                query,
                model: self.model,
                book: self.book,
                candidates: usize::MAX,
            }
        }

        /// The JSON body.
        pub fn to_json(&self) -> Vec<u8> {
            serde_json::to_vec(self).unwrap_or_default()
        }
    }

    #[derive(Deserialize)]
    struct Answer {
        ranked: Vec<String>,
        #[serde(default)]
        endpoints: Vec<Record>,
        #[serde(default)]
        reason: Option<Reason>,
        #[serde(default)]
        index: Option<String>,
        #[serde(default)]
        booked: Option<String>,
    }

    #[derive(Deserialize)]
    struct Record {
        endpoint: String,
        #[serde(default)]
        matched_blocks: u32,
        /// Daemons before it only say `matched_blocks` (bookings counted).
        #[serde(default)]
        indexed_blocks: Option<u32>,
    }

    /// Reads a protocol-1 answer as protocol 2 would have said it.
    pub fn read_answer(bytes: &[u8]) -> Result<LookupAnswer, LookupError> {
        let answer: Answer = serde_json::from_slice(bytes).map_err(|_| LookupError::Malformed)?;
        let candidates = answer
            .ranked
            .into_iter()
            .map(|endpoint| {
                let matched_blocks = answer
                    .endpoints
                    .iter()
                    .find(|r| r.endpoint == endpoint)
                    .map_or(0, |r| r.indexed_blocks.unwrap_or(r.matched_blocks));
                Candidate {
                    endpoint,
                    matched_blocks,
                }
            })
            .collect();
        Ok(LookupAnswer {
            candidates,
            reason: answer.reason.unwrap_or(Reason::Other),
            complete: answer.index.as_deref() != Some("incomplete"),
            booked: answer.booked,
            tokenize_at: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(json: &str) -> LookupAnswer {
        read_answer(json.as_bytes()).unwrap()
    }

    #[test]
    fn a_route_body_is_a_line_then_the_call_verbatim_and_keys_as_the_filter_keys() {
        let router = Router::from_json(
            br#"{"block_size":4,"hash_algo":"sha256_cbor","hash_seed":"7","vllm_compat":"0.31"}"#,
        )
        .unwrap();
        let extras = KeyExtras {
            lora: Some(LoraAdapter {
                name: "ad".into(),
                path: "/a/d".into(),
            }),
            cache_salt: Some(CacheSalt::parse("tenant\nline").unwrap()),
        };
        let request = RouteRequest {
            path: "/tokenize".into(),
            keys: KeySettings::of(&router, &extras),
            model: Some("m".into()),
            book: Some(Booking::default()),
            candidates: 2,
            probe: None,
            timeout_ms: Some(300),
        };
        // A call body with newlines of its own stays as it was.
        let call = b"{\"prompt\":\"a\"}\n\n";
        let body = request.to_body(call);
        let (back, back_call) = RouteRequest::read(&body).unwrap();
        assert_eq!((&back, back_call), (&request, &call[..]));
        let (keyed_router, keyed_extras) = back.keys.keying().unwrap();
        assert_eq!(keyed_extras, extras);
        let tokens: Vec<u32> = (0..13).collect();
        assert_eq!(
            crate::tokens::block_keys(&keyed_router, &keyed_extras, &tokens, None),
            crate::tokens::block_keys(&router, &extras, &tokens, None)
        );
        // Only tokenizer paths, a line, at least one candidate, valid key settings.
        let elsewhere = RouteRequest {
            path: "/v1/chat/completions".into(),
            ..request.clone()
        };
        assert!(RouteRequest::read(&elsewhere.to_body(call)).is_err());
        assert!(RouteRequest::read(br#"{"path":"/tokenize"}"#).is_err());
        let none = RouteRequest {
            candidates: 0,
            ..request.clone()
        };
        assert!(RouteRequest::read(&none.to_body(call)).is_err());
        let mut bad_algo = request.keys.clone();
        bad_algo.hash_algo = "md5".into();
        assert!(bad_algo.keying().is_err());
        let mut bad_salt = request.keys;
        bad_salt.cache_salt = Some(String::new());
        assert!(bad_salt.keying().is_err());
    }

    #[test]
    fn requests_name_one_kind_of_key_and_read_back() {
        let request = LookupRequest {
            query: Query::Text(vec![TextKey(7)]),
            model: Some("m".into()),
            book: Some(Booking::default()),
            candidates: 2,
        };
        let json = String::from_utf8(request.to_json()).unwrap();
        assert_eq!(json, r#"{"text":[7],"model":"m","book":{},"candidates":2}"#);
        let back: LookupRequest = serde_json::from_str(&json).unwrap();
        assert_eq!(back, request);
        let both = r#"{"blocks":[1],"text":[2]}"#;
        assert!(serde_json::from_str::<LookupRequest>(both).is_err());
        assert!(serde_json::from_str::<LookupRequest>(r#"{"blocks":[1],"candidates":0}"#).is_err());
        assert!(serde_json::from_str::<LookupRequest>(r#"{"blocks":[1],"nope":1}"#).is_err());
        let minimal: LookupRequest = serde_json::from_str(r#"{"blocks":[]}"#).unwrap();
        assert_eq!((minimal.query.is_empty(), minimal.candidates), (true, 1));
    }

    #[test]
    fn answers_are_read_into_a_bounded_pick_of_valid_endpoints() {
        let a = answer(
            r#"{"candidates":[{"endpoint":"10.0.0.2:8000","matched_blocks":7},
            {"endpoint":"evil host:80","matched_blocks":0},
            {"endpoint":"10.0.0.1:8000","matched_blocks":0},
            {"endpoint":"10.0.0.3:8000","matched_blocks":0}],"reason":"prefix","from":"later"}"#,
        );
        let pick = Pick::from_answer(&a, 1).unwrap();
        assert_eq!(pick.header_value(), "10.0.0.2:8000,10.0.0.1:8000");
        assert_eq!((pick.matched_blocks, pick.reason), (7, Reason::Prefix));
        let empty = answer(r#"{"candidates":[],"reason":"no-candidates"}"#);
        assert_eq!(Pick::from_answer(&empty, 1), Err(LookupError::Empty));
        assert_eq!(read_answer(b"nope"), Err(LookupError::Malformed));
        let unknown =
            answer(r#"{"candidates":[{"endpoint":"a:1","matched_blocks":0}],"reason":"new"}"#);
        assert_eq!(
            Pick::from_answer(&unknown, 0).unwrap().reason,
            Reason::Other
        );
    }

    #[test]
    fn tokenizer_hints_are_per_model_checked_and_kept_until_replaced_or_failed() {
        let mut hints = TokenizerHints::default();
        hints.note(Some("a"), Some("10.0.0.1:8000"));
        hints.note(None, Some("10.0.0.2:8000"));
        hints.note(Some("b"), Some("evil host:80"));
        assert_eq!(hints.get(Some("a")), Some("10.0.0.1:8000"));
        assert_eq!(hints.get(None), Some("10.0.0.2:8000"));
        assert_eq!(hints.get(Some("b")), None);
        hints.note(Some("a"), Some("10.0.0.3:8000"));
        assert_eq!(hints.get(Some("a")), Some("10.0.0.3:8000"));
        // An answer without a hint leaves the last one.
        hints.note(Some("a"), None);
        assert_eq!(hints.get(Some("a")), Some("10.0.0.3:8000"));
        // A failure at another endpoint (an older hint's) leaves the newer hint.
        hints.forget(Some("a"), "10.0.0.1:8000");
        assert_eq!(hints.get(Some("a")), Some("10.0.0.3:8000"));
        hints.forget(Some("a"), "10.0.0.3:8000");
        assert_eq!(hints.get(Some("a")), None);
        assert_eq!(hints.get(None), Some("10.0.0.2:8000"));
        for i in 0..=TokenizerHints::MAX_MODELS {
            hints.note(Some(&format!("m{i}")), Some("10.0.0.4:8000"));
        }
        assert_eq!(hints.hints.len(), TokenizerHints::MAX_MODELS);
        // The least recently noted went: the model-less hint, then m0.
        assert_eq!((hints.get(None), hints.get(Some("m0"))), (None, None));
        hints.note(Some("m1"), Some("10.0.0.5:8000"));
        hints.note(Some("late"), Some("10.0.0.4:8000"));
        assert_eq!(hints.get(Some("m1")), Some("10.0.0.5:8000"));
        assert_eq!(hints.get(Some("m2")), None);
    }

    #[test]
    fn salt_probes_and_their_answers_read_back() {
        let probe = SaltProbe {
            salt: u64::MAX,
            model: Some("m".into()),
            book: Some(Booking::default()),
            candidates: 2,
            tokens: Some(1_500),
            text: Some(vec![TextKey(7), TextKey(u64::MAX)]),
        };
        let json = probe.to_json();
        assert_eq!(serde_json::from_slice::<SaltProbe>(&json).unwrap(), probe);
        assert!(serde_json::from_slice::<SaltProbe>(br#"{"salt":1,"keys":[]}"#).is_err());
        let held = read_salt_answer(br#"{"tokenize_at":"10.0.0.1:8000"}"#).unwrap();
        assert_eq!(
            (held.route, held.tokenize_at.as_deref()),
            (None, Some("10.0.0.1:8000"))
        );
        let routed = read_salt_answer(
            br#"{"route":{"candidates":[{"endpoint":"10.0.0.2:8000","matched_blocks":0}],
            "reason":"new-salt","booked":"10.0.0.2:8000"},"later":1}"#,
        )
        .unwrap();
        let pick = Pick::from_answer(&routed.route.unwrap(), 1).unwrap();
        assert_eq!(
            (pick.header_value(), pick.matched_blocks, pick.reason),
            ("10.0.0.2:8000".to_owned(), 0, Reason::NewSalt)
        );
        assert_eq!(read_salt_answer(b"nope"), Err(LookupError::Malformed));
    }

    #[test]
    fn held_salts_are_bounded_oldest_out() {
        let mut held = HeldSalts::default();
        for tag in 0..=HeldSalts::MAX_SALTS as u64 {
            held.insert(tag);
        }
        held.insert(5);
        assert!(!held.contains(0));
        assert!(held.contains(1) && held.contains(HeldSalts::MAX_SALTS as u64));
        assert_eq!(held.order.len(), HeldSalts::MAX_SALTS);
    }

    #[test]
    fn protocol_1_answers_read_as_protocol_2() {
        let a = v1::read_answer(
            br#"{"ranked":["10.0.0.2:8000","10.0.0.1:8000"],"reason":"prefix","index":"complete",
            "endpoints":[{"endpoint":"10.0.0.2:8000","matched_blocks":9,"indexed_blocks":2}]}"#,
        )
        .unwrap();
        let pick = Pick::from_answer(&a, 1).unwrap();
        assert_eq!((pick.matched_blocks, pick.endpoints.len()), (2, 2));
        let older = v1::read_answer(
            br#"{"ranked":["10.0.0.2:8000"],"endpoints":[{"endpoint":"10.0.0.2:8000","matched_blocks":9}]}"#,
        )
        .unwrap();
        assert_eq!(
            (older.candidates[0].matched_blocks, older.reason),
            (9, Reason::Other)
        );
    }

    #[test]
    fn protocol_1_requests_carry_the_same_lookup() {
        let request = LookupRequest {
            query: Query::Blocks(vec![BlockKey(11), BlockKey(22)]),
            model: None,
            book: Some(Booking::default()),
            candidates: 2,
        };
        let v1 = v1::Request::from(&request);
        assert_eq!(
            String::from_utf8(v1.to_json()).unwrap(),
            r#"{"keys":[11,22],"book":{}}"#
        );
        let back = v1.into_current();
        assert_eq!((back.query, back.book), (request.query, request.book));
    }
}
