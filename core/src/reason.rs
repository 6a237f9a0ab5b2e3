//! Why a request went where it went: the one spelling of every routing outcome. The
//! `x-kvaffine-reason` header, the filter's Envoy stats, the daemon's answer and its
//! metrics all take their names from [`Reason::as_str`].

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The outcome of routing one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Pinned: the replica holds the longest prefix and is not saturated.
    Prefix,
    /// Pinned: no usable replica holds a prefix worth following, so the least loaded.
    Load,
    /// Pinned: a replica with a longer prefix was saturated; affinity yielded to load.
    Saturated,
    /// Pinned without tokenizing: no replica holds a block of the request's `cache_salt`
    /// (nor is one booked for it), so no cached prefix can match; the least loaded.
    NewSalt,
    /// Pinned without tokenizing: the salt's first request was booked on this replica and
    /// no replica's events show the salt yet; it follows that request.
    SaltBooked,
    /// Pinned for a reason this filter does not know (a newer daemon's).
    Other,
    /// Unpinned: the index knows no replica that can take the request.
    NoCandidates,
    /// Unpinned: the body is not a JSON object (the replica answers its own 400).
    UnparsedBody,
    /// Unpinned: vLLM will refuse the `cache_salt` with a 400.
    InvalidCacheSalt,
    /// Unpinned: `previous_response_id` history lives in one replica's memory.
    PreviousResponse,
    /// Unpinned: the body cannot be rendered (vLLM answers 400 too).
    Unrenderable,
    /// Unpinned: no prompt in the body.
    NoPrompt,
    /// Unpinned: the body is larger than `max_body_bytes`.
    BodyTooLarge,
    /// Unpinned: the gateway could not hand the body over.
    BodyUnreadable,
    /// The tokenizer failed (the request may still be routed on text keys).
    TokenizeFailed,
    /// Unpinned: the index did not answer usefully in time.
    IndexUnavailable,
    /// Not a routed API (method or path): passed through.
    Passthrough,
    /// Routing is off for this route.
    Disabled,
}

impl Reason {
    /// Every reason, for tables that count each one.
    pub const ALL: [Self; 18] = [
        Self::Prefix,
        Self::Load,
        Self::Saturated,
        Self::NewSalt,
        Self::SaltBooked,
        Self::Other,
        Self::NoCandidates,
        Self::UnparsedBody,
        Self::InvalidCacheSalt,
        Self::PreviousResponse,
        Self::Unrenderable,
        Self::NoPrompt,
        Self::BodyTooLarge,
        Self::BodyUnreadable,
        Self::TokenizeFailed,
        Self::IndexUnavailable,
        Self::Passthrough,
        Self::Disabled,
    ];

    /// The name headers, stats, metrics and the wire use.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefix => "prefix",
            Self::Load => "load",
            Self::Saturated => "saturated",
            Self::NewSalt => "new-salt",
            Self::SaltBooked => "salt-booked",
            Self::Other => "other",
            Self::NoCandidates => "no-candidates",
            Self::UnparsedBody => "unparsed-body",
            Self::InvalidCacheSalt => "invalid-cache-salt",
            Self::PreviousResponse => "previous-response",
            Self::Unrenderable => "unrenderable",
            Self::NoPrompt => "no-prompt",
            Self::BodyTooLarge => "body-too-large",
            Self::BodyUnreadable => "body-unreadable",
            Self::TokenizeFailed => "tokenize-failed",
            Self::IndexUnavailable => "index-unavailable",
            Self::Passthrough => "passthrough",
            Self::Disabled => "disabled",
        }
    }

    /// The reason named `name`, if this build knows it.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == name)
    }

    /// Whether the request was pinned to a replica.
    pub fn pinned(self) -> bool {
        matches!(
            self,
            Self::Prefix
                | Self::Load
                | Self::Saturated
                | Self::NewSalt
                | Self::SaltBooked
                | Self::Other
        )
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Reason {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// A name this build does not know reads as [`Reason::Other`]: a newer daemon's new reason
/// must not make its answers unreadable.
impl<'de> Deserialize<'de> for Reason {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = std::borrow::Cow::<str>::deserialize(deserializer)?;
        Ok(Self::parse(&name).unwrap_or(Self::Other))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_has_its_own_name_and_reads_back() {
        let names: std::collections::HashSet<&str> =
            Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(names.len(), Reason::ALL.len());
        for reason in Reason::ALL {
            let json = serde_json::to_string(&reason).unwrap();
            assert_eq!(serde_json::from_str::<Reason>(&json).unwrap(), reason);
        }
        assert_eq!(
            serde_json::from_str::<Reason>(r#""from-the-future""#).unwrap(),
            Reason::Other
        );
    }
}
