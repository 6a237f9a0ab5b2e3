//! `cache_salt`: the per-tenant value that keeps one tenant's prompts from ever sharing KV
//! blocks (and so routing affinity) with another's.

use std::fmt;

/// The longest salt vLLM (>= 0.30) accepts, in characters (Python `len`, code points).
pub const MAX_CACHE_SALT_CHARS: usize = 128;

/// Characters vLLM (>= 0.30) rejects in a salt.
const FORBIDDEN: [char; 4] = ['@', '/', '\\', '\0'];

/// Why vLLM would answer 400 (`param: "cache_salt"`) to a request carrying this salt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CacheSaltError {
    /// vLLM requires a non-empty string.
    #[error("cache_salt must be a non-empty string")]
    Empty,
    /// vLLM caps salts at [`MAX_CACHE_SALT_CHARS`] characters.
    #[error("cache_salt has {chars} characters; vLLM accepts at most {MAX_CACHE_SALT_CHARS}")]
    TooLong {
        /// Length of the rejected salt in characters.
        chars: usize,
    },
    /// vLLM rejects `@`, `/`, `\` and NUL.
    #[error("cache_salt contains {0:?}, which vLLM rejects (no '@', '/', '\\\\' or NUL)")]
    ForbiddenChar(char),
}

/// A salt vLLM accepts, so keys built from it match what the replica computes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CacheSalt(String);

impl CacheSalt {
    /// Validates `salt` exactly as vLLM's `validate_cache_salt` does.
    pub fn parse(salt: &str) -> Result<Self, CacheSaltError> {
        if salt.is_empty() {
            return Err(CacheSaltError::Empty);
        }
        if let Some(c) = salt.chars().find(|c| FORBIDDEN.contains(c)) {
            return Err(CacheSaltError::ForbiddenChar(c));
        }
        let chars = salt.chars().count();
        if chars > MAX_CACHE_SALT_CHARS {
            return Err(CacheSaltError::TooLong { chars });
        }
        Ok(Self(salt.to_owned()))
    }

    /// The salt as vLLM hashes it.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The salt's tag: how the filter asks kvaffined whether any replica holds a block of
    /// this salt without sending the salt itself (xxh3-64 of its UTF-8 bytes; kvaffined
    /// tags the salts in its replicas' events alike). Two salts sharing a tag only cost a
    /// tokenizer call.
    pub fn tag(&self) -> u64 {
        salt_tag(&self.0)
    }
}

/// The tag of a salt as it appears in a KV event ([`CacheSalt::tag`]).
pub fn salt_tag(salt: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(salt.as_bytes())
}

impl fmt::Display for CacheSalt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_what_vllm_accepts() {
        for ok in ["tenant-a", "x", &"é".repeat(128), "a b:c|d"] {
            assert_eq!(CacheSalt::parse(ok).unwrap().as_str(), ok);
        }
    }

    #[test]
    fn rejects_what_vllm_rejects() {
        assert_eq!(CacheSalt::parse(""), Err(CacheSaltError::Empty));
        assert_eq!(
            CacheSalt::parse(&"a".repeat(129)),
            Err(CacheSaltError::TooLong { chars: 129 })
        );
        for (bad, c) in [("a@b", '@'), ("a/b", '/'), ("a\\b", '\\'), ("a\0b", '\0')] {
            assert_eq!(CacheSalt::parse(bad), Err(CacheSaltError::ForbiddenChar(c)));
        }
    }
}
