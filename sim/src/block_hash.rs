//! vLLM's `sha256_cbor` prefix-caching block hash, bit for bit.
//!
//! Each full block is hashed as `sha256(cbor([parent_digest, [token ids], extra_keys]))`, chained
//! through the parent's full 32-byte digest; the first block's parent is `NONE_HASH`, the
//! digest of the CBOR text `PYTHONHASHSEED` when that is set and of `"vllm-none-hash"` otherwise
//! ([`root_hash`]). What vLLM puts on the wire is either the last 8 bytes of the digest read
//! big-endian ([`BlockHash::wire_id`], its default `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`) or
//! the whole 32-byte digest (`=0`); `events::HashFormat` chooses. Either way a consumer of the
//! simulator's events sees what a real vLLM run with `--prefix-caching-hash-algo sha256_cbor`
//! and the same `PYTHONHASHSEED` would publish.
//!
//! A block's *extra keys* go in the third slot: CBOR null without any, else the list of vLLM's
//! tagged keys ([`ExtraKey`]), in its order: `["lora", name, path]` on every block of a LoRA
//! request, then `["cache_salt", salt]` on the first block of a salted request (so a salt changes
//! every later block through the chain). [`ExtraKey::event_value`] is the untagged form vLLM 0.32
//! publishes in `BlockStored.extra_keys`.
//!
//! This module owns only the hash function; which blocks get hashed is the KV cache's business.

use sha2::{Digest, Sha256};
use std::sync::OnceLock;

/// A full 32-byte block digest, as vLLM keeps it internally.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

impl BlockHash {
    /// The 64-bit id vLLM publishes in KV events: the digest's last 8 bytes, big-endian.
    pub fn wire_id(&self) -> u64 {
        let mut tail = [0u8; 8];
        tail.copy_from_slice(&self.0[24..]);
        u64::from_be_bytes(tail)
    }
}

impl std::fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockHash({:016x})", self.wire_id())
    }
}

/// The chain root without `PYTHONHASHSEED`: `sha256(cbor_text("vllm-none-hash"))`.
pub fn none_hash() -> BlockHash {
    static ROOT: OnceLock<BlockHash> = OnceLock::new();
    *ROOT.get_or_init(|| text_digest("vllm-none-hash"))
}

/// The chain root vLLM's `init_none_hash` derives: `sha256_cbor(PYTHONHASHSEED)`, the seed
/// hashed verbatim as a CBOR text string (`"0"` and `"00"` differ), or [`none_hash`] unset.
pub fn root_hash(python_hash_seed: Option<&str>) -> BlockHash {
    match python_hash_seed {
        Some(seed) => text_digest(seed),
        None => none_hash(),
    }
}

fn text_digest(text: &str) -> BlockHash {
    let mut buf = Vec::with_capacity(text.len() + 9);
    cbor_head(&mut buf, 3, text.len() as u64);
    buf.extend_from_slice(text.as_bytes());
    BlockHash(Sha256::digest(&buf).into())
}

/// Hashes one full block of tokens chained to `parent` (`None` for the first block, chained to
/// [`none_hash`]).
pub fn hash_block(parent: Option<&BlockHash>, tokens: &[u32]) -> BlockHash {
    hash_block_from(&parent.copied().unwrap_or_else(none_hash), tokens)
}

/// Hashes one full block of tokens chained to `parent` (the chain root for the first block).
pub fn hash_block_from(parent: &BlockHash, tokens: &[u32]) -> BlockHash {
    hash_block_with(parent, tokens, &[])
}

/// One of vLLM's extra hash keys of a block (`generate_block_hash_extra_keys`), as it is
/// hashed: tagged with its source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtraKey<'a> {
    /// The request's LoRA adapter: `("lora", name, path)`, on every block.
    Lora {
        /// Adapter name.
        name: &'a str,
        /// Adapter path.
        path: &'a str,
    },
    /// The request's `cache_salt`: `("cache_salt", salt)`, on the first block only.
    CacheSalt(&'a str),
}

impl<'a> ExtraKey<'a> {
    /// The untagged value vLLM publishes in a `BlockStored` event's `extra_keys`
    /// (`to_event_extra_keys`): the adapter's name, or the salt.
    pub fn event_value(&self) -> &'a str {
        match self {
            ExtraKey::Lora { name, .. } => name,
            ExtraKey::CacheSalt(salt) => salt,
        }
    }

    fn write_cbor(&self, buf: &mut Vec<u8>) {
        let texts: &[&str] = match self {
            ExtraKey::Lora { name, path } => &["lora", name, path],
            ExtraKey::CacheSalt(salt) => &["cache_salt", salt],
        };
        cbor_head(buf, 4, texts.len() as u64);
        for t in texts {
            cbor_head(buf, 3, t.len() as u64);
            buf.extend_from_slice(t.as_bytes());
        }
    }
}

/// Hashes one full block of tokens with its extra keys (none: [`hash_block_from`]).
pub fn hash_block_with(parent: &BlockHash, tokens: &[u32], extra: &[ExtraKey<'_>]) -> BlockHash {
    // 1 + 34 (bytes head + digest) + 9 (array head) + 5 per token + 1 (null)
    let mut buf = Vec::with_capacity(48 + tokens.len() * 5);
    cbor_head(&mut buf, 4, 3);
    cbor_head(&mut buf, 2, 32);
    buf.extend_from_slice(&parent.0);
    cbor_head(&mut buf, 4, tokens.len() as u64);
    for &t in tokens {
        cbor_head(&mut buf, 0, u64::from(t));
    }
    if extra.is_empty() {
        buf.push(0xf6); // extra_keys = None
    } else {
        cbor_head(&mut buf, 4, extra.len() as u64);
        extra.iter().for_each(|k| k.write_cbor(&mut buf));
    }
    BlockHash(Sha256::digest(&buf).into())
}

/// Writes a canonical (shortest-form) CBOR head for `major` type with argument `value`.
fn cbor_head(buf: &mut Vec<u8>, major: u8, value: u64) {
    let m = major << 5;
    match value {
        0..=23 => buf.push(m | value as u8),
        // Additional information 24 to 27 (0x18 to 0x1b): 1, 2, 4 or 8 bytes follow.
        24..=0xff => buf.extend_from_slice(&[m | 0x18, value as u8]),
        0x100..=0xffff => {
            buf.push(m | 0x19);
            buf.extend_from_slice(&(value as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            buf.push(m | 0x1a);
            buf.extend_from_slice(&(value as u32).to_be_bytes());
        }
        _ => {
            buf.push(m | 0x1b);
            buf.extend_from_slice(&value.to_be_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Known answers from vLLM 0.33 with --prefix-caching-hash-algo sha256_cbor
    // (docs/vllm-interface.md, "Block-hash algorithms").
    #[test]
    fn matches_vllm_test_vector() {
        let root = none_hash();
        assert_eq!(&root.0[..2], &[0x9b, 0xd9]);
        assert_eq!(&root.0[29..], &[0x81, 0xee, 0xf0]);
        let b0 = hash_block(None, &[1, 2, 3, 4]);
        assert_eq!(b0.wire_id(), 9561501211280363793);
        let b1 = hash_block(Some(&b0), &[5, 6, 7, 8]);
        assert_eq!(b1.wire_id(), 15292913576410714033);
    }

    #[test]
    fn python_hash_seed_changes_the_root_as_in_vllm() {
        // docs/vllm-interface.md: with PYTHONHASHSEED=0 the first block's wire int is this.
        let root = root_hash(Some("0"));
        assert_eq!((&root.0[..4], &root.0[28..]), (&[0x4e, 0x11, 0x95, 0xdf][..], &[0xf2, 0xe6, 0x1c, 0x3e][..]));
        assert_eq!(hash_block_from(&root, &[1, 2, 3, 4]).wire_id(), 2164874634404590027);
        assert_eq!(root_hash(None), none_hash());
        assert_ne!(root_hash(Some("00")), root);
    }

    // Known answers from vLLM 0.32's own `hash_block_tokens(sha256_cbor, ...)` with the extra
    // keys its `generate_block_hash_extra_keys` makes for a salted request (`cache_salt` "s1"),
    // and for the same request on LoRA adapter "sql" at "/lora/sql".
    #[test]
    fn salted_and_lora_blocks_match_vllm() {
        let b0 = hash_block_with(&none_hash(), &[1, 2, 3, 4], &[ExtraKey::CacheSalt("s1")]);
        assert_eq!(b0.wire_id(), 13058387990771713016);
        assert_eq!(hash_block(Some(&b0), &[5, 6, 7, 8]).wire_id(), 6674538477739822157);
        let lora = ExtraKey::Lora { name: "sql", path: "/lora/sql" };
        let l0 = hash_block_with(&none_hash(), &[1, 2, 3, 4], &[lora, ExtraKey::CacheSalt("s1")]);
        assert_eq!(l0.wire_id(), 7159120940714972288);
        assert_eq!(hash_block_with(&l0, &[5, 6, 7, 8], &[lora]).wire_id(), 14524530562472585525);
        assert_eq!((lora.event_value(), ExtraKey::CacheSalt("s1").event_value()), ("sql", "s1"));
    }

    #[test]
    fn large_token_ids_use_wide_cbor_ints() {
        // Different widths must give different, stable digests (no truncation of ids).
        let a = hash_block(None, &[23, 24, 255, 256]);
        let b = hash_block(None, &[23, 24, 255, 65536]);
        assert_ne!(a, b);
        assert_eq!(a, hash_block(None, &[23, 24, 255, 256]));
    }
}
