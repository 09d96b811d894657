//! kvgate's block hash: 64-bit, chained, over full blocks of u32 token ids.
//!
//! `h_i = link(h_{i-1}, xxh3_64(tokens[i·bs..(i+1)·bs], seed'))` with `h_{-1} = seed'` and
//! `link(p, c) = (rotl(p, 32) ^ c) · φ` (φ the odd golden-ratio constant), over the tokens'
//! in-memory bytes (u32, native endian; hashes never leave the process), and
//! `seed' = seed ^ xxh3_64(lora_name)` for an adapter (the base model uses `seed`). Each
//! block's content hash is independent of the others, so the CPU overlaps them; only the cheap
//! `link` is serial (an 8k-token prompt hashes in ~2 µs, benches/RESULTS.md). A
//! partial tail block is ignored. Because each hash covers its whole prefix, one lookup per block answers "does this
//! worker hold the prefix up to here".
//!
//! Requests and event `token_ids` go through this same function, so kvgate never depends on
//! vLLM's hash algorithm or `PYTHONHASHSEED`: engine hashes are only ids for parent links and
//! removals.

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
        let content = xxh3_64_with_seed(bytemuck::cast_slice(tokens), self.seed);
        let h = link(parent.unwrap_or(self.seed), content);
        // 0 is reserved for "empty"; the remap costs nothing measurable.
        if h == 0 { 1 } else { h }
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
        let n = (tokens.len() / self.block_size).min(max_blocks);
        self.chain(None, &tokens[..n * self.block_size])
    }
}

/// One link of the chain: a bijection of the parent for a fixed block and of the block for a
/// fixed parent, so prefixes that differ once stay different whatever follows. It is the only
/// serial step of [`Hasher::chain`]: a rotate, an xor and one multiply (~5 cycles) where a full
/// finaliser took ~14. `content` is already an avalanche-complete xxh3, so the product needs
/// no finaliser; the rotation feeds the parent's well-mixed high bits into the product's low
/// bits, which the flat index reads first.
#[inline]
fn link(parent: BlockHash, content: u64) -> BlockHash {
    (parent.rotate_left(32) ^ content).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// splitmix64 (golden-ratio step + finaliser): a fast bijection with full avalanche. Also the
/// gateway's source of cheap well-mixed numbers (random routing, tie-breaks, request ids).
#[inline]
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A deterministic stream of well-mixed numbers from `seed` (splitmix64: a golden-ratio counter
/// through [`mix`]): the random inputs of tests, the same on every run so a failure reproduces.
pub fn sequence(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed;
    move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(state)
    }
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
}
