//! kvgate's block hash: 64-bit, chained, over full blocks of u32 token ids.
//!
//! `h_i = link(h_{i-1}, content(tokens[i·bs..(i+1)·bs], seed'))` with `h_{-1} = seed'` and
//! `link(p, c) = (rotl(p, 32) ^ c) · φ` (φ the odd golden-ratio constant), and
//! `seed' = seed ^ xxh3_64(lora_name)` for an adapter (the base model uses `seed`). [`content`]
//! folds each pair of 64-bit words (four tokens) through one 64×64→128-bit multiply with seeded
//! keys and the sum through one more: the structure of xxh3's 16-byte mix, without the length
//! dispatch and secret arithmetic of a general-purpose hash, which were most of the routing
//! decision's hashing. Hashes are compared only with hashes of the same kvgate build (a
//! replica's peers included: docs/replicas.md). Each block's content hash is independent of the
//! others, so the CPU overlaps them; only the cheap `link` is serial. A partial tail block is
//! ignored. Because each hash covers its whole prefix, one lookup per block answers "does this
//! worker hold the prefix up to here".
//!
//! Requests and event `token_ids` go through this same function, so kvgate never depends on
//! vLLM's hash algorithm or `PYTHONHASHSEED`: engine hashes are only ids for parent links and
//! removals.
//!
//! **Extra keys.** vLLM mixes more than tokens into a block's hash: the LoRA adapter (every
//! block; here, the seed above), a request's `cache_salt` (the first block only, so every later
//! block differs through the chain), multimodal items and prompt embeddings (the blocks they
//! cover). Such a block's extra keys reduce to one 64-bit *extra digest* ([`salt_digest`] for a
//! salt alone, [`opaque_digest`] for anything else), and the block's content hash is taken with
//! the seed `seed ^ mix(extra)` ([`Hasher::chain_with`]). A salt's digest is the same from a
//! request's `cache_salt` and from a `BlockStored` event's `extra_keys`, so salted prefixes
//! match only requests with the same salt; opaque digests are odd and salt digests even, so a
//! multimodal or embeddings block never matches a text request. Blocks without extra keys are
//! hashed with the seed alone ([`Hasher::chain`]).

use std::sync::atomic::{AtomicU64, Ordering};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// A chained block hash (never 0: 0 marks empty slots in the flat index).
pub type BlockHash = u64;

/// Default seed.
pub const DEFAULT_SEED: u64 = 0x6b76_6761_7465_0001;

/// How to hash blocks for one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hasher {
    seed: u64,
    block_size: usize,
}

impl Hasher {
    /// A hasher for `block_size`-token blocks (≥ 1), base model.
    pub fn new(block_size: usize, seed: u64) -> Self {
        assert!(block_size >= 1, "validated by the config");
        Self { seed, block_size }
    }

    /// The same hasher for a LoRA adapter: its identity is mixed into the seed.
    pub fn with_lora(self, lora_name: Option<&str>) -> Self {
        match lora_name {
            Some(name) if !name.is_empty() => Self { seed: self.seed ^ xxh3_64_with_seed(name.as_bytes(), 0x4c6f_5241), ..self },
            _ => self,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Hash of one full block given its parent's hash (`None` for the first block).
    #[inline]
    pub fn block(&self, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        debug_assert_eq!(tokens.len(), self.block_size);
        let h = link(parent.unwrap_or(self.seed), content(tokens, self.seed));
        // 0 is reserved for "empty"; the remap costs nothing measurable.
        if h == 0 { 1 } else { h }
    }

    /// Hash of one full block whose extra keys digest to `extra` (see the module doc); `None`
    /// is [`Hasher::block`].
    #[inline]
    pub fn block_with(&self, parent: Option<BlockHash>, tokens: &[u32], extra: Option<u64>) -> BlockHash {
        let Some(extra) = extra else { return self.block(parent, tokens) };
        debug_assert_eq!(tokens.len(), self.block_size);
        let h = link(parent.unwrap_or(self.seed), content(tokens, self.seed ^ mix(extra)));
        if h == 0 { 1 } else { h }
    }

    /// [`Hasher::chain`] with per-block extra digests: `extras[i]` belongs to the `i`-th full
    /// block of `tokens`; blocks past the end of `extras` have none. Without any extra digest it
    /// is [`Hasher::chain`] itself (the fast path).
    pub fn chain_with(&self, parent: Option<BlockHash>, tokens: &[u32], extras: &[Option<u64>]) -> Vec<BlockHash> {
        if extras.iter().all(Option::is_none) {
            return self.chain(parent, tokens);
        }
        let mut out = Vec::with_capacity(tokens.len() / self.block_size);
        let mut prev = parent;
        for (i, block) in tokens.chunks_exact(self.block_size).enumerate() {
            let h = self.block_with(prev, block, extras.get(i).copied().flatten());
            out.push(h);
            prev = Some(h);
        }
        out
    }

    /// Chained hashes of every full block of `tokens`, continuing from `parent`.
    pub fn chain(&self, parent: Option<BlockHash>, tokens: &[u32]) -> Vec<BlockHash> {
        let mut out = Vec::with_capacity(tokens.len() / self.block_size);
        let mut prev = parent;
        for block in tokens.chunks_exact(self.block_size) {
            let h = self.block(prev, block);
            out.push(h);
            prev = Some(h);
        }
        out
    }

    /// Hashes of at most `max_blocks` leading full blocks (routing rarely needs more).
    pub fn chain_prefix(&self, tokens: &[u32], max_blocks: usize) -> Vec<BlockHash> {
        self.chain_prefix_with(tokens, max_blocks, &[])
    }

    /// [`Hasher::chain_prefix`] with per-block extra digests, as [`Hasher::chain_with`].
    pub fn chain_prefix_with(&self, tokens: &[u32], max_blocks: usize, extras: &[Option<u64>]) -> Vec<BlockHash> {
        let n = (tokens.len() / self.block_size).min(max_blocks);
        self.chain_with(None, &tokens[..n * self.block_size], extras)
    }
}

/// The extra digest of a block whose only extra key (besides the LoRA adapter) is the
/// request's `cache_salt`: the same from a request body and from a KV event. Even, so it never
/// equals an [`opaque_digest`]. vLLM ignores an empty salt; callers pass only non-empty ones.
pub fn salt_digest(salt: &str) -> u64 {
    xxh3_64_with_seed(salt.as_bytes(), 0x5361_6c74) & !1
}

/// The extra digest of a block whose extra keys are anything but a salt alone (multimodal
/// items, prompt-embeddings digests, a shape kvgate does not know), from their encoded bytes.
/// Odd, so no text request (whose blocks carry at most a [`salt_digest`]) can match it.
pub fn opaque_digest(encoded_keys: &[u8]) -> u64 {
    xxh3_64_with_seed(encoded_keys, 0x4f70_6171) | 1
}

/// φ: 2^64 over the golden ratio, rounded to odd. Stepping by it visits every 64-bit value
/// with consecutive steps far apart, and multiplying by it spreads low bits upward: the chain's
/// link, [`mix`]'s counter and [`content`]'s key offsets all use it, and the workspace's
/// seeded counters step by it.
pub const PHI: u64 = 0x9e37_79b9_7f4a_7c15;

/// Odd 64-bit keys of [`content`], one per word of a pair, cycled over longer blocks; the last
/// pair keys the final fold.
const KEYS: [u64; 10] = [
    0xa076_1d64_78bd_642f,
    0xe703_7ed1_a0b4_28db,
    0x8ebc_6af0_9c88_c6e3,
    0x5899_65cc_7537_4cc3,
    0x1d8e_4e27_c47d_124f,
    0xb2ad_e2d1_0be9_5b8b,
    0x2d35_8dcc_aa6c_78a5,
    0x4b33_a62e_d433_d4a3,
    PHI,
    0xbf58_476d_1ce4_e5b9,
];

/// The 128-bit product of `a` and `b`, its halves folded by xor: every input bit reaches the
/// middle bits of the result, and the fold carries them to both ends.
#[inline(always)]
fn fold_mul(a: u64, b: u64) -> u64 {
    let r = u128::from(a) * u128::from(b);
    #[allow(clippy::cast_possible_truncation, reason = "the product's two halves, folded")]
    let (lo, hi) = (r as u64, (r >> 64) as u64);
    lo ^ hi
}

/// The content hash of one block of `tokens` under `seed` (module doc): each four tokens, as
/// two 64-bit words (little-endian pairs of token ids), xored with keys that depend on the seed
/// and on their position and folded through one multiply; the sum, with the block's length,
/// through one more. A block of 16 tokens (vLLM's default `block_size`) is four independent
/// multiplies and the fold, which the compiler unrolls.
#[inline(always)]
pub fn content(tokens: &[u32], seed: u64) -> u64 {
    if tokens.len() == 16 {
        return content_of(&tokens[..16], seed);
    }
    content_of(tokens, seed)
}

/// [`content`] for any length (the caller's length check lets the compiler unroll a fixed one).
/// The keys cycle every 16 tokens, offset by a golden-ratio step per cycle, so groups of four
/// tokens that trade places anywhere in a longer block hash differently.
#[inline(always)]
fn content_of(tokens: &[u32], seed: u64) -> u64 {
    let word = |q: &[u32], i: usize| u64::from(q.get(i).copied().unwrap_or(0)) | (u64::from(q.get(i + 1).copied().unwrap_or(0)) << 32);
    let mut acc = 0u64;
    for (i, q) in tokens.chunks(4).enumerate() {
        let (k, cycle) = ((2 * i) % 8, (i / 4) as u64);
        let offset = seed.wrapping_add(cycle.wrapping_mul(PHI));
        acc = acc.wrapping_add(fold_mul(word(q, 0) ^ KEYS[k].wrapping_add(offset), word(q, 2) ^ KEYS[k + 1].wrapping_sub(offset)));
    }
    fold_mul(acc ^ seed ^ KEYS[8], (tokens.len() as u64) ^ KEYS[9])
}

/// One link of the chain: a bijection of the parent for a fixed block and of the block for a
/// fixed parent, so prefixes that differ once stay different whatever follows. It is the only
/// serial step of [`Hasher::chain`]: a rotate, an xor and one multiply, a fraction of a full
/// finaliser's latency. `content` already ends in a full multiply fold, so the product needs
/// no finaliser; the rotation feeds the parent's well-mixed high bits into the product's low
/// bits, which the flat index reads first.
#[inline]
fn link(parent: BlockHash, content: u64) -> BlockHash {
    (parent.rotate_left(32) ^ content).wrapping_mul(PHI)
}

/// splitmix64 (golden-ratio step + finaliser): a fast bijection with full avalanche. Also the
/// gateway's source of cheap well-mixed numbers (random routing, tie-breaks, request ids).
#[inline]
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(PHI);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A deterministic stream of well-mixed numbers from `seed` (splitmix64: a golden-ratio counter
/// through [`mix`]): the random inputs of tests, the same on every run so a failure reproduces.
pub fn sequence(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed;
    move || {
        state = state.wrapping_add(PHI);
        mix(state)
    }
}

/// The next number of a [`sequence`] shared by threads through `counter`, without a lock: the
/// gateway's cheap draws (random routing, tie-breaks), each stepping the counter once.
pub fn next_shared(counter: &AtomicU64) -> u64 {
    mix(counter.fetch_add(PHI, Ordering::Relaxed))
}

/// Hashes for maps keyed by the gateway's own `u64` ids (request registrations, bookings): one
/// [`mix`] instead of SipHash, which guards against keys an attacker picks and costs several
/// times more; these keys come from a counter.
#[derive(Debug, Clone, Copy, Default)]
pub struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        mix(self.0)
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` keys are hashed here; anything else folds in byte by byte.
        bytes.iter().for_each(|&b| self.0 = self.0.rotate_left(8) ^ u64::from(b));
    }

    fn write_u64(&mut self, n: u64) {
        self.0 ^= n;
    }
}

/// The [`std::hash::BuildHasher`] of [`IdHasher`].
pub type BuildIdHasher = std::hash::BuildHasherDefault<IdHasher>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_counter_draws_the_sequence_of_its_start() {
        let counter = AtomicU64::new(7);
        let mut seq = sequence(7);
        // The counter's first draw mixes its start; the sequence steps before its first.
        assert_eq!(next_shared(&counter), mix(7));
        assert_eq!([next_shared(&counter), next_shared(&counter)], [seq(), seq()]);
        assert_eq!(counter.load(Ordering::Relaxed), 7u64.wrapping_add(3u64.wrapping_mul(PHI)));
    }

    #[test]
    fn chained_partial_tail_ignored_and_deterministic() {
        let h = Hasher::new(4, DEFAULT_SEED);
        let t: Vec<u32> = (0..11).collect();
        let c = h.chain(None, &t);
        assert_eq!(c.len(), 2, "11 tokens = 2 full blocks");
        assert_eq!(c, h.chain(None, &t[..8]));
        assert_eq!(c[1], h.block(Some(c[0]), &t[4..8]));
        // Same block content under a different prefix hashes differently.
        let other: Vec<u32> = [9, 9, 9, 9].into_iter().chain(4..8).collect();
        assert_ne!(h.chain(None, &other)[1], c[1]);
        // Continuing a chain equals hashing the whole sequence.
        assert_eq!(h.chain(Some(c[0]), &t[4..8]), vec![c[1]]);
        assert!(c.iter().all(|&x| x != 0));
    }

    #[test]
    fn seed_and_lora_separate_hash_spaces() {
        let t: Vec<u32> = (0..16).collect();
        let base = Hasher::new(16, 1);
        assert_ne!(base.chain(None, &t), Hasher::new(16, 2).chain(None, &t));
        let lora = base.with_lora(Some("sql-adapter"));
        assert_ne!(base.chain(None, &t), lora.chain(None, &t));
        assert_eq!(base.with_lora(None), base);
        assert_eq!(base.with_lora(Some("")), base);
        let big = Hasher::new(128, 1);
        let t2: Vec<u32> = (0..256).collect();
        assert_eq!(big.chain(None, &t2).len(), 2);
    }

    #[test]
    fn extra_digests_separate_blocks_and_change_every_later_hash() {
        let h = Hasher::new(4, DEFAULT_SEED);
        let t: Vec<u32> = (0..12).collect();
        let plain = h.chain(None, &t);
        // No extras (or only `None`s) is the plain chain.
        assert_eq!(h.chain_with(None, &t, &[]), plain);
        assert_eq!(h.chain_with(None, &t, &[None, None, None, None]), plain);
        // A salt on block 0 changes it and, through the chain, every block after it.
        let salt = salt_digest("tenant-a");
        let salted = h.chain_with(None, &t, &[Some(salt)]);
        assert!(salted.iter().zip(&plain).all(|(a, b)| a != b));
        assert_eq!(salted, h.chain_with(None, &t, &[Some(salt), None, None]));
        assert_ne!(salted, h.chain_with(None, &t, &[Some(salt_digest("tenant-b"))]));
        // Continuing a salted chain needs no extras after block 0.
        assert_eq!(h.chain_with(Some(salted[0]), &t[4..], &[]), salted[1..]);
        assert_eq!(h.chain_prefix_with(&t, 2, &[Some(salt)]), salted[..2]);
        // Salt digests are even, opaque ones odd: never equal.
        for s in ["", "a", "tenant-a", "x".repeat(100).as_str()] {
            assert_eq!(salt_digest(s) & 1, 0);
            assert_eq!(opaque_digest(s.as_bytes()) & 1, 1);
        }
        // The LoRA seed and an extra digest combine: neither alone gives the same hash.
        let lora = h.with_lora(Some("sql"));
        assert_ne!(lora.chain_with(None, &t, &[Some(salt)]), salted);
        assert_ne!(lora.chain_with(None, &t, &[Some(salt)]), lora.chain(None, &t));
    }

    #[test]
    fn prefixes_that_differ_once_never_meet_and_hashes_spread() {
        let h = Hasher::new(16, DEFAULT_SEED);
        // 4,096 prompts that differ only in their first block and share 8 blocks after it.
        let tail: Vec<u32> = (0..128).collect();
        let mut seen = std::collections::HashSet::new();
        let mut buckets = [0u32; 64];
        for first in 0..4096u32 {
            let prompt: Vec<u32> = (0..16).map(|t| first * 16 + t).chain(tail.iter().copied()).collect();
            for x in h.chain(None, &prompt) {
                assert!(seen.insert(x), "two different prefixes hashed alike");
                // The flat index homes a key by its low bytes first (bswap).
                buckets[(x & 63) as usize] += 1;
            }
        }
        let mean = seen.len() as f64 / 64.0;
        assert!(buckets.iter().all(|&b| (f64::from(b) - mean).abs() < mean * 0.15), "{buckets:?}");
    }

    #[test]
    fn every_token_bit_reaches_about_half_the_content_hash() {
        // Flipping any one bit of any token of a 16-token block changes about half of the
        // content hash's bits, over many random blocks and seeds.
        let mut next = sequence(7);
        let (mut flipped, mut trials) = (0u64, 0u64);
        let mut least = u32::MAX;
        for _ in 0..200 {
            let seed = next();
            let block: Vec<u32> = (0..16).map(|_| next() as u32).collect();
            let base = content(&block, seed);
            for t in 0..16 {
                for bit in 0..32 {
                    let mut b = block.clone();
                    b[t] ^= 1 << bit;
                    let d = (content(&b, seed) ^ base).count_ones();
                    least = least.min(d);
                    flipped += u64::from(d);
                    trials += 1;
                }
            }
        }
        let mean = flipped as f64 / trials as f64;
        assert!((mean - 32.0).abs() < 0.5, "mean bits changed {mean}");
        assert!(least >= 8, "a one-bit change moved only {least} bits");
    }

    #[test]
    fn other_block_sizes_hash_every_token_and_their_length() {
        let seed = DEFAULT_SEED;
        for len in [1usize, 3, 5, 7, 16, 17, 32, 33, 128] {
            let t: Vec<u32> = (0..len as u32).map(|x| x * 7 + 1).collect();
            for i in 0..len {
                let mut u = t.clone();
                u[i] += 1;
                assert_ne!(content(&t, seed), content(&u, seed), "len {len} token {i}");
            }
            // A trailing zero token is not padding.
            let mut z = t.clone();
            z.push(0);
            assert_ne!(content(&t, seed), content(&z, seed), "len {len}");
            assert_ne!(content(&t, seed), content(&t, seed ^ 1));
        }
        // Groups of four tokens a whole key cycle (16 tokens) apart, swapped, differ too.
        for len in [32usize, 64, 128] {
            let t: Vec<u32> = (0..len as u32).map(|x| x * 7 + 1).collect();
            for (a, b) in [(0, 16), (4, 20), (0, 48), (12, 124)] {
                if b + 4 > len {
                    continue;
                }
                let mut u = t.clone();
                for j in 0..4 {
                    u.swap(a + j, b + j);
                }
                assert_ne!(content(&t, seed), content(&u, seed), "len {len}: groups at {a} and {b} swapped");
            }
        }
    }
}
