//! The step-time model: how long one engine step (one forward pass over the scheduled batch)
//! takes, from what the step contains.
//!
//! ```text
//! step_ms = step_overhead_ms
//!         + prefill_ms_per_token     · Σ chunk_tokens                         (prefill GEMMs)
//!         + prefill_attn_ms_per_pair · Σ chunk_tokens · (chunk_ctx + chunk_tokens/2)  (prefill attention)
//!         + decode_ms_per_seq        · decode_batch_size                      (decode GEMMs)
//!         + decode_ms_per_ctx_token  · Σ decode_context_tokens                (KV reads in decode attention)
//! ```
//! Unlike Dynamo's mocker, decode time grows with the batch and with the context each decoding
//! sequence attends over, and prefill attention grows with the prefix already in the cache.
//!
//! Defaults approximate Llama-3.1-8B in bf16 on one H100 with vLLM: ~6 ms fixed per step
//! (weights streamed once per step plus launch overhead), ~28k prefill tokens/s, a 4k-token
//! prefill ≈ 160 ms, and KV reads of 128 KiB per context token at ~3 TB/s (4e-5 ms/token): a
//! batch of 64 sequences at 2k context decodes in ≈ 13 ms per step.
//!
//! Prefill/decode disaggregation adds one cost outside the steps: a decode worker pulling a
//! prompt's KV from a prefill worker waits `kv_transfer_ms_per_token · block_size` per block it
//! reads. The default is that model's 128 KiB of KV per token (2 · 32 layers · 8 KV heads · 128
//! dims · 2 bytes) over a 25 GB/s link (NVLink-class, or 200 Gb/s RDMA): 131,072 B / 25e9 B/s
//! ≈ 5.2 µs per token, 84 µs per 16-token block, 84 ms for a 16k-token prompt.

use serde::{Deserialize, Serialize};

/// Parameters of the step-time model, in milliseconds of simulated time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TimingModel {
    /// Fixed cost of any non-empty step.
    pub step_overhead_ms: f64,
    /// Cost per prefill token scheduled in the step.
    pub prefill_ms_per_token: f64,
    /// Cost per (new prefill token × token attended to).
    pub prefill_attn_ms_per_pair: f64,
    /// Cost per sequence decoding one token in the step.
    pub decode_ms_per_seq: f64,
    /// Cost per context token read by the decoding sequences.
    pub decode_ms_per_ctx_token: f64,
    /// Time to pull one token's KV from a prefill worker (P/D disaggregation).
    #[serde(default = "default_kv_transfer_ms_per_token")]
    pub kv_transfer_ms_per_token: f64,
}

/// 128 KiB of KV per token over 25 GB/s, in ms (the module docs derive it).
const KV_TRANSFER_MS_PER_TOKEN: f64 = 131_072.0 / 25e9 * 1e3;

fn default_kv_transfer_ms_per_token() -> f64 {
    KV_TRANSFER_MS_PER_TOKEN
}

impl Default for TimingModel {
    fn default() -> Self {
        Self {
            step_overhead_ms: 6.0,
            prefill_ms_per_token: 0.035,
            prefill_attn_ms_per_pair: 1.3e-6,
            decode_ms_per_seq: 0.03,
            decode_ms_per_ctx_token: 4.0e-5,
            kv_transfer_ms_per_token: KV_TRANSFER_MS_PER_TOKEN,
        }
    }
}

/// What one step contains, accumulated by the scheduler.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepShape {
    /// Prefill tokens scheduled in the step.
    pub prefill_tokens: u64,
    /// Σ chunk_tokens · (chunk_ctx + chunk_tokens/2) over prefill chunks.
    pub prefill_attn_pairs: f64,
    /// Sequences decoding one token.
    pub decode_seqs: u64,
    /// Σ context length over decoding sequences.
    pub decode_ctx_tokens: u64,
}

impl StepShape {
    /// Adds a prefill chunk of `tokens` new tokens on top of `ctx` already-computed ones.
    pub fn add_prefill(&mut self, ctx: usize, tokens: usize) {
        self.prefill_tokens += tokens as u64;
        self.prefill_attn_pairs += tokens as f64 * (ctx as f64 + tokens as f64 / 2.0);
    }

    /// Adds one decoding sequence whose context (including the new token) is `ctx` tokens.
    pub fn add_decode(&mut self, ctx: usize) {
        self.decode_seqs += 1;
        self.decode_ctx_tokens += ctx as u64;
    }

    /// Whether the step schedules nothing.
    pub fn is_empty(&self) -> bool {
        self.prefill_tokens == 0 && self.decode_seqs == 0
    }
}

impl TimingModel {
    /// Checks every parameter is finite and non-negative.
    pub fn validate(&self) -> Result<(), String> {
        let fields = [
            ("step_overhead_ms", self.step_overhead_ms),
            ("prefill_ms_per_token", self.prefill_ms_per_token),
            ("prefill_attn_ms_per_pair", self.prefill_attn_ms_per_pair),
            ("decode_ms_per_seq", self.decode_ms_per_seq),
            ("decode_ms_per_ctx_token", self.decode_ms_per_ctx_token),
            ("kv_transfer_ms_per_token", self.kv_transfer_ms_per_token),
        ];
        for (name, v) in fields {
            if !v.is_finite() || v < 0.0 {
                return Err(format!("timing parameter {name} must be a finite number >= 0, got {v}"));
            }
        }
        Ok(())
    }

    /// Simulated duration of a step, in milliseconds.
    pub fn step_ms(&self, s: &StepShape) -> f64 {
        if s.is_empty() {
            return 0.0;
        }
        self.step_overhead_ms
            + self.prefill_ms_per_token * s.prefill_tokens as f64
            + self.prefill_attn_ms_per_pair * s.prefill_attn_pairs
            + self.decode_ms_per_seq * s.decode_seqs as f64
            + self.decode_ms_per_ctx_token * s.decode_ctx_tokens as f64
    }

    /// Simulated time to pull `blocks` KV blocks of `block_size` tokens, in milliseconds.
    pub fn kv_transfer_ms(&self, blocks: usize, block_size: usize) -> f64 {
        self.kv_transfer_ms_per_token * (blocks * block_size) as f64
    }
}

#[cfg(test)]
#[allow(clippy::float_cmp, reason = "tests compare exact values, computed by the same arithmetic as their expectations")]
mod tests {
    use super::*;

    #[test]
    fn decode_cost_grows_with_batch_and_context() {
        let m = TimingModel::default();
        let step = |seqs: usize, ctx: usize| {
            let mut s = StepShape::default();
            (0..seqs).for_each(|_| s.add_decode(ctx));
            m.step_ms(&s)
        };
        assert!(step(64, 2048) > step(8, 2048));
        assert!(step(64, 8192) > step(64, 2048));
        let b64 = step(64, 2048);
        assert!((10.0..20.0).contains(&b64), "64 seqs at 2k ctx: {b64} ms");
    }

    #[test]
    fn prefill_cost_grows_with_tokens_and_cached_prefix() {
        let m = TimingModel::default();
        let pre = |ctx: usize, n: usize| {
            let mut s = StepShape::default();
            s.add_prefill(ctx, n);
            m.step_ms(&s)
        };
        assert!(pre(0, 4096) > pre(0, 1024));
        assert!(pre(8192, 1024) > pre(0, 1024));
        let p4k = pre(0, 4096);
        assert!((120.0..250.0).contains(&p4k), "4k prefill: {p4k} ms");
        assert_eq!(m.step_ms(&StepShape::default()), 0.0);
    }

    #[test]
    fn kv_transfer_time_follows_the_link() {
        let m = TimingModel::default();
        let block = m.kv_transfer_ms(1, 16);
        assert!((0.08..0.09).contains(&block), "a 16-token block: {block} ms");
        assert_eq!(m.kv_transfer_ms(0, 16), 0.0);
        assert!((m.kv_transfer_ms(1000, 16) - 1000.0 * block).abs() < 1e-9);
    }

    #[test]
    fn rejects_negative_or_nan() {
        let neg = TimingModel { decode_ms_per_seq: -1.0, ..TimingModel::default() };
        assert!(neg.validate().is_err());
        let nan = TimingModel { step_overhead_ms: f64::NAN, ..TimingModel::default() };
        assert!(nan.validate().is_err());
    }
}
