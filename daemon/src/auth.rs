//! Optional bearer tokens on kvaffined's API (`--auth-token-file`): lookups and the
//! endpoint list answer only requests that carry one of the file's tokens; `/healthz`,
//! `/readyz` and `/metrics` stay open for probes and scrapers.
//!
//! The file holds one token per line (blank lines and `#` comments ignored), so a rotation
//! adds the new token, rolls the gateways over, then removes the old one. It is re-read
//! when it changes (checked at most once a second, on the request path); a rewrite that
//! leaves it unreadable or without a token keeps the tokens already loaded.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use parking_lot::Mutex;
use tracing::{info, warn};

/// How often the file's modification time is looked at.
const RECHECK: Duration = Duration::from_secs(1);

/// The tokens the API accepts, following the file they come from.
pub struct ApiTokens {
    path: PathBuf,
    loaded: Mutex<Loaded>,
}

struct Loaded {
    tokens: Vec<String>,
    modified: Option<SystemTime>,
    checked: Instant,
}

impl ApiTokens {
    /// Reads `path`; fails when it cannot be read or names no token, so a mistyped path
    /// never leaves the API open.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let tokens = read_tokens(path)?;
        info!(path = %path.display(), tokens = tokens.len(), "API tokens loaded");
        Ok(Self {
            path: path.to_owned(),
            loaded: Mutex::new(Loaded {
                tokens,
                modified: modified(path),
                checked: Instant::now(),
            }),
        })
    }

    /// The first token of the file, as this daemon presents to its peers (daemons in
    /// front of the same replicas share one token file).
    pub fn first(&self) -> Option<String> {
        self.loaded.lock().tokens.first().cloned()
    }

    /// Whether an `authorization` header value is `Bearer <one of the tokens>`.
    pub fn allows(&self, authorization: Option<&[u8]>) -> bool {
        let Some(offered) = authorization.and_then(|v| v.strip_prefix(b"Bearer ")) else {
            return false;
        };
        let mut loaded = self.loaded.lock();
        if loaded.checked.elapsed() >= RECHECK {
            loaded.checked = Instant::now();
            let now_modified = modified(&self.path);
            if now_modified != loaded.modified {
                loaded.modified = now_modified;
                match read_tokens(&self.path) {
                    Ok(tokens) => {
                        info!(path = %self.path.display(), tokens = tokens.len(), "API tokens re-read");
                        loaded.tokens = tokens;
                    }
                    Err(err) => warn!("keeping the API tokens already loaded: {err:#}"),
                }
            }
        }
        // Every token is compared in full, so the time taken does not say how much of a
        // guess matched.
        loaded
            .tokens
            .iter()
            .fold(false, |any, token| any | same(token.as_bytes(), offered))
    }
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn read_tokens(path: &Path) -> anyhow::Result<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the token file {}", path.display()))?;
    let tokens: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    if tokens.is_empty() {
        bail!("the token file {} names no token", path.display());
    }
    Ok(tokens)
}

/// Equality whose time depends on the lengths only.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_listed_bearer_tokens_pass_and_rotation_follows_the_file() {
        let dir = std::env::temp_dir().join(format!("kvaffined-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokens");
        std::fs::write(&path, "# rotated monthly\nold-token\n\n").unwrap();
        let tokens = ApiTokens::load(&path).unwrap();
        assert!(tokens.allows(Some(b"Bearer old-token")));
        for refused in [
            None,
            Some(&b"old-token"[..]),
            Some(b"Bearer old-toke"),
            Some(b"Bearer old-tokenx"),
            Some(b"bearer old-token"),
            Some(b"Bearer # rotated monthly"),
        ] {
            assert!(!tokens.allows(refused), "{refused:?}");
        }
        std::fs::write(&path, "old-token\nnew-token\n").unwrap();
        tokens.loaded.lock().checked -= RECHECK;
        tokens.loaded.lock().modified = None;
        assert!(tokens.allows(Some(b"Bearer new-token")));
        assert!(tokens.allows(Some(b"Bearer old-token")));
        // Emptied by mistake: the loaded tokens stay.
        std::fs::write(&path, "\n").unwrap();
        tokens.loaded.lock().checked -= RECHECK;
        tokens.loaded.lock().modified = None;
        assert!(tokens.allows(Some(b"Bearer new-token")));
        std::fs::write(dir.join("empty"), "# none\n").unwrap();
        assert!(ApiTokens::load(&dir.join("empty")).is_err());
        assert!(ApiTokens::load(&dir.join("missing")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
