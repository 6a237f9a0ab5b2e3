//! The ZMQ message layouts around event payloads: live PUB messages, the replay
//! (ROUTER/DEALER) exchange, and the per-rank endpoint shift of data-parallel replicas.

/// The sequence number that ends a replay reply (`(-1).to_bytes(8, "big", signed=True)`).
pub const END_SEQ: u64 = u64::MAX;

/// Why a multipart message is not one a vLLM publisher sends.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Live messages have 3 frames, replay messages 3 (vLLM <= 0.25) or 4 (>= 0.26).
    #[error("expected {expected} frames, got {got}")]
    FrameCount {
        /// The accepted count(s).
        expected: &'static str,
        /// What arrived.
        got: usize,
    },
    /// Sequence numbers are 8 bytes, big-endian.
    #[error("sequence frame has {0} bytes, expected 8")]
    SeqLength(usize),
    /// A DEALER receives an empty delimiter frame first.
    #[error("replay message does not start with an empty delimiter frame")]
    MissingDelimiter,
}

/// One live message from a replica's PUB socket, borrowed from its frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveMessage<'a> {
    /// The configured topic (possibly empty).
    pub topic: &'a [u8],
    /// Per-publisher sequence number, from 0 at process start.
    pub seq: u64,
    /// The msgpack batch.
    pub payload: &'a [u8],
}

/// One message of a replay reply, as a DEALER receives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayMessage<'a> {
    /// A buffered batch; `topic` is `None` in the pre-0.26 layout.
    Batch {
        /// The publisher's topic, when the layout carries it.
        topic: Option<&'a [u8]>,
        /// The batch's sequence number.
        seq: u64,
        /// The msgpack batch.
        payload: &'a [u8],
    },
    /// The end of the reply.
    End,
}

fn seq_of(frame: &[u8]) -> Result<u64, FrameError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| FrameError::SeqLength(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// Splits a live message `[topic, seq_be8, payload]`.
pub fn parse_live<F: AsRef<[u8]>>(frames: &[F]) -> Result<LiveMessage<'_>, FrameError> {
    match frames {
        [topic, seq, payload] => Ok(LiveMessage {
            topic: topic.as_ref(),
            seq: seq_of(seq.as_ref())?,
            payload: payload.as_ref(),
        }),
        _ => Err(FrameError::FrameCount {
            expected: "3",
            got: frames.len(),
        }),
    }
}

/// Splits a replay message as a DEALER sees it: `["", topic, seq, payload]` (>= 0.26) or
/// `["", seq, payload]` (<= 0.25); the end marker has seq [`END_SEQ`].
pub fn parse_replay<F: AsRef<[u8]>>(frames: &[F]) -> Result<ReplayMessage<'_>, FrameError> {
    let (delimiter, topic, seq, payload) = match frames {
        [d, t, s, p] => (d.as_ref(), Some(t.as_ref()), s.as_ref(), p.as_ref()),
        [d, s, p] => (d.as_ref(), None, s.as_ref(), p.as_ref()),
        _ => {
            return Err(FrameError::FrameCount {
                expected: "3 or 4",
                got: frames.len(),
            });
        }
    };
    if !delimiter.is_empty() {
        return Err(FrameError::MissingDelimiter);
    }
    let seq = seq_of(seq)?;
    if seq == END_SEQ {
        return Ok(ReplayMessage::End);
    }
    Ok(ReplayMessage::Batch {
        topic,
        seq,
        payload,
    })
}

/// The frames a DEALER sends to ask for every buffered batch with seq >= `start_seq`.
pub fn replay_request(start_seq: u64) -> [Vec<u8>; 2] {
    [Vec::new(), start_seq.to_be_bytes().to_vec()]
}

/// The start seq of a replay request as a ROUTER receives it (`[identity, "", start]`),
/// read like vLLM does (`int.from_bytes(frame, "big")`, any length up to 8 bytes).
pub fn start_seq_of_replay_request<F: AsRef<[u8]>>(frames: &[F]) -> Result<u64, FrameError> {
    match frames {
        [_identity, delimiter, start] if delimiter.as_ref().is_empty() => {
            let start = start.as_ref();
            if start.len() > 8 {
                return Err(FrameError::SeqLength(start.len()));
            }
            Ok(start.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
        }
        [_, _, _] => Err(FrameError::MissingDelimiter),
        _ => Err(FrameError::FrameCount {
            expected: "3",
            got: frames.len(),
        }),
    }
}

/// A live message as a PUB socket sends it.
pub fn live_frames(topic: &[u8], seq: u64, payload: &[u8]) -> [Vec<u8>; 3] {
    [topic.to_vec(), seq.to_be_bytes().to_vec(), payload.to_vec()]
}

/// One replayed batch as a vLLM >= 0.26 ROUTER sends it to `identity`.
pub fn replay_frames(identity: &[u8], topic: &[u8], seq: u64, payload: &[u8]) -> [Vec<u8>; 5] {
    [
        identity.to_vec(),
        Vec::new(),
        topic.to_vec(),
        seq.to_be_bytes().to_vec(),
        payload.to_vec(),
    ]
}

/// The end of a replay reply as a vLLM >= 0.26 ROUTER sends it to `identity`.
pub fn replay_end_frames(identity: &[u8]) -> [Vec<u8>; 5] {
    [
        identity.to_vec(),
        Vec::new(),
        Vec::new(),
        END_SEQ.to_be_bytes().to_vec(),
        Vec::new(),
    ]
}

/// Why an endpoint cannot be shifted for a data-parallel rank.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointError {
    /// vLLM only shifts `tcp://` and `inproc://` endpoints.
    #[error("endpoint {0:?} is neither tcp:// nor inproc://")]
    Scheme(String),
    /// A tcp endpoint needs a numeric port.
    #[error("endpoint {0:?} has no numeric port")]
    Port(String),
}

/// The endpoint data-parallel rank `rank` of a replica publishes on, given the configured
/// one: vLLM adds the rank to a tcp port (port 0, an ephemeral bind, is left alone) and
/// appends `_dp<rank>` to an inproc name.
pub fn offset_endpoint_for_rank(endpoint: &str, rank: u32) -> Result<String, EndpointError> {
    if endpoint.starts_with("inproc://") {
        return Ok(if rank == 0 {
            endpoint.to_owned()
        } else {
            format!("{endpoint}_dp{rank}")
        });
    }
    if !endpoint.starts_with("tcp://") {
        return Err(EndpointError::Scheme(endpoint.to_owned()));
    }
    let (base, port) = endpoint
        .rsplit_once(':')
        .ok_or_else(|| EndpointError::Port(endpoint.to_owned()))?;
    let port: u32 = port
        .parse()
        .map_err(|_| EndpointError::Port(endpoint.to_owned()))?;
    if port == 0 {
        return Ok(endpoint.to_owned());
    }
    Ok(format!("{base}:{}", port + rank))
}
