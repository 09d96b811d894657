//! Deterministic "sampling": the next token is a pure function of the simulator seed and the
//! whole token context so far (prompt plus everything generated before it).
//!
//! Because the context is folded into a rolling hash, a request that is continued on another
//! worker with its generated tokens appended to the prompt yields exactly the same continuation
//! as the original would have; migration and mid-stream failover tests rely on this.
//!
//! Tokens are drawn from the tokenizer's "output vocabulary": ids that decode on their own to
//! non-empty printable text (no special tokens, no partial UTF-8), so generated text is made of
//! real tokens and its concatenation equals the decoded sequence.

use std::sync::Arc;

/// Rolling hash of a token context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextHash(u64);

impl ContextHash {
    /// The hash of the empty context under `seed`.
    pub fn new(seed: u64) -> Self {
        Self(mix(seed ^ 0x6b76_6761_7465_2d73))
    }

    /// Folds one more token into the context.
    pub fn push(self, token: u32) -> Self {
        Self(mix(self.0 ^ (u64::from(token) + 1).wrapping_mul(PHI)))
    }

    /// Folds a slice of tokens.
    pub fn extend(self, tokens: &[u32]) -> Self {
        tokens.iter().fold(self, |h, &t| h.push(t))
    }
}

/// 2^64 over the golden ratio, rounded to odd: the step of the simulator's counters and the
/// multiplier of its context hash.
pub(crate) const PHI: u64 = 0x9e37_79b9_7f4a_7c15;

/// splitmix64's finaliser: a fast, well-mixed 64-bit bijection (the simulator's one copy).
pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Picks next tokens.
#[derive(Debug, Clone)]
pub struct Sampler {
    vocab: Arc<[u32]>,
    eos: Option<u32>,
    /// Probability of EOS per step, in parts per million (0 = never stop early).
    eos_ppm: u64,
}

impl Sampler {
    /// A sampler over `vocab` (must be non-empty) with an optional EOS token and per-token EOS
    /// probability.
    pub fn new(vocab: Arc<[u32]>, eos: Option<u32>, eos_probability: f64) -> Self {
        assert!(!vocab.is_empty(), "validated when the tokenizer is loaded");
        #[allow(clippy::cast_sign_loss, reason = "a probability clamped to 0..=1, in parts per million: not negative")]
        let eos_ppm = (eos_probability.clamp(0.0, 1.0) * 1e6).round() as u64;
        Self { vocab, eos, eos_ppm }
    }

    /// The next token after context `h`. EOS is only produced when `allow_eos`.
    pub fn next(&self, h: ContextHash, allow_eos: bool) -> u32 {
        let r = mix(h.0 ^ 0x5851_f42d_4c95_7f2d);
        if allow_eos
            && self.eos_ppm > 0
            && (r % 1_000_000) < self.eos_ppm
            && let Some(eos) = self.eos
        {
            return eos;
        }
        self.vocab[((r >> 20) % self.vocab.len() as u64) as usize]
    }

    /// The end-of-sequence token, if the tokenizer has one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continuation_after_appending_generated_tokens_is_identical() {
        let s = Sampler::new((10..500).collect::<Vec<u32>>().into(), None, 0.0);
        let prompt = [5u32, 6, 7, 8, 9];
        let mut h = ContextHash::new(42).extend(&prompt);
        let mut out = Vec::new();
        for _ in 0..20 {
            let t = s.next(h, true);
            out.push(t);
            h = h.push(t);
        }
        // "Migrate" after 7 tokens: new prompt = prompt + first 7 generated.
        let mut p2 = prompt.to_vec();
        p2.extend_from_slice(&out[..7]);
        let mut h2 = ContextHash::new(42).extend(&p2);
        for &want in &out[7..] {
            let t = s.next(h2, true);
            assert_eq!(t, want);
            h2 = h2.push(t);
        }
    }

    #[test]
    fn seed_and_context_change_the_output() {
        let s = Sampler::new((0..1000).collect::<Vec<u32>>().into(), None, 0.0);
        let a: Vec<u32> = (0..8).map(|i| s.next(ContextHash::new(1).push(i), true)).collect();
        let b: Vec<u32> = (0..8).map(|i| s.next(ContextHash::new(2).push(i), true)).collect();
        assert_ne!(a, b);
    }

    #[test]
    fn eos_respects_probability_and_permission() {
        let s = Sampler::new(vec![1u32, 2, 3].into(), Some(0), 0.5);
        let mut h = ContextHash::new(7);
        let (mut eos, mut n) = (0, 0);
        for i in 0..10_000u32 {
            h = h.push(i);
            n += 1;
            if s.next(h, true) == 0 {
                eos += 1;
            }
            assert_ne!(s.next(h, false), 0);
        }
        let frac = f64::from(eos) / f64::from(n);
        assert!((0.45..0.55).contains(&frac), "eos fraction {frac}");
    }
}
