//! Keys from request text, for the approximate mode: no tokenizer call, matched against
//! where earlier requests with the same text went, never against vLLM's block keys.

use serde::{Deserialize, Serialize};

use crate::config::Router;
use crate::keys::KeyExtras;

/// A key of request text. Its own type, so text keys and vLLM's block keys
/// ([`crate::BlockKey`]) can never be looked up in each other's index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TextKey(pub u64);

/// Keys from request text, for approximate routing: fixed-size byte chunks, each key
/// chained from the previous one and seeded by the model and salt (so salts never share
/// keys here either). Only full chunks are keyed.
pub fn approximate_keys(
    router: &Router,
    model: Option<&str>,
    extras: &KeyExtras,
    text: &str,
) -> Vec<TextKey> {
    templated_keys(router, model, extras, &[], text)
}

/// [`approximate_keys`] seeded also by `template`, the request's other inputs to its
/// chat template (tools, template arguments): two requests whose texts agree but whose
/// templates differ render different tokens from the first block on, so their keys must
/// not agree either. An empty `template` gives the approximate keys.
pub fn templated_keys(
    router: &Router,
    model: Option<&str>,
    extras: &KeyExtras,
    template: &[u8],
    text: &str,
) -> Vec<TextKey> {
    use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};
    let mut seed_material = Vec::new();
    seed_material.extend_from_slice(model.unwrap_or("").as_bytes());
    seed_material.push(0);
    if let Some(salt) = &extras.cache_salt {
        seed_material.extend_from_slice(salt.as_str().as_bytes());
    }
    seed_material.push(0);
    if let Some(lora) = &extras.lora {
        seed_material.extend_from_slice(lora.name.as_bytes());
    }
    if !template.is_empty() {
        seed_material.push(0);
        seed_material.extend_from_slice(template);
    }
    let mut key = xxh3_64(&seed_material);
    text.as_bytes()
        .chunks_exact(router.config.approximate_chunk_bytes)
        .map(|chunk| {
            key = xxh3_64_with_seed(chunk, key);
            TextKey(key)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::salt::CacheSalt;

    #[test]
    fn approximate_keys_follow_text_prefixes_and_salts() {
        let r = Router::from_json(br#"{"block_size":4,"approximate_chunk_bytes":8}"#).unwrap();
        let keys = |text: &str, salt: Option<&str>| {
            let extras = KeyExtras {
                cache_salt: salt.map(|s| CacheSalt::parse(s).unwrap()),
                ..KeyExtras::default()
            };
            approximate_keys(&r, Some("m"), &extras, text)
        };
        let short = keys("0123456789abcdefXYZ", None);
        let long = keys("0123456789abcdefXYZ0123456789", None);
        assert_eq!(short.len(), 2);
        assert_eq!(&long[..2], &short[..]);
        assert_ne!(keys("0123456789abcdef", Some("s")), short);
        assert_ne!(
            keys("0123456789abcdef", None)[0],
            approximate_keys(&r, Some("other"), &KeyExtras::default(), "0123456789abcdef")[0]
        );
    }
}
