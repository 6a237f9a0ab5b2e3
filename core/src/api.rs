//! Which OpenAI API a request is, from its path.

use crate::config::Router;

/// The request APIs kvaffine understands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`.
    ChatCompletions,
    /// `/v1/completions`.
    Completions,
    /// `/v1/responses`.
    Responses,
}

impl Api {
    fn of(path: &[u8]) -> Option<Self> {
        if path.ends_with(b"/chat/completions") {
            Some(Self::ChatCompletions)
        } else if path.ends_with(b"/completions") {
            Some(Self::Completions)
        } else if path.ends_with(b"/responses") {
            Some(Self::Responses)
        } else {
            None
        }
    }
}

impl Router {
    /// The API a POST to `path` (query string ignored) is, if it is routed. A configured
    /// path also matches under a route prefix the gateway rewrites away
    /// (`/approximate/v1/chat/completions`).
    pub fn api(&self, path: &[u8]) -> Option<Api> {
        let path = path.split(|b| *b == b'?').next().unwrap_or(path);
        if !self
            .config
            .paths
            .iter()
            .any(|p| path.ends_with(p.as_bytes()))
        {
            return None;
        }
        Api::of(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_configured_post_paths_are_routed() {
        let r = Router::from_json(br#"{"block_size":4}"#).unwrap();
        assert_eq!(
            r.api(b"/v1/chat/completions?x=1"),
            Some(Api::ChatCompletions)
        );
        assert_eq!(r.api(b"/v1/completions"), Some(Api::Completions));
        assert_eq!(r.api(b"/v1/responses"), Some(Api::Responses));
        assert_eq!(r.api(b"/v1/models"), None);
        assert_eq!(r.api(b"/approximate/v1/responses"), Some(Api::Responses));
        let narrow = Router::from_json(br#"{"block_size":4,"paths":["/v1/responses"]}"#).unwrap();
        assert_eq!(narrow.api(b"/v1/chat/completions"), None);
    }
}
