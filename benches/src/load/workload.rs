//! Workloads: what to send and when. Open-loop request lists (a Mooncake trace replay, or
//! synthetic shared-prefix traffic with Poisson arrivals) and closed-loop multi-turn chat
//! sessions (each turn waits for the previous answer and sends the history back).

use crate::Rng;
use crate::trace::{self, TraceRequest};
use serde_json::{Value, json};
use std::time::Duration;

/// One request of an open-loop workload.
#[derive(Debug, Clone)]
pub struct Job {
    /// When to send it, from the start of the run.
    pub at: Duration,
    /// `/v1/completions` or `/v1/chat/completions`.
    pub path: &'static str,
    /// The body without `model` (added by the runner).
    pub body: Value,
}

/// A multi-turn chat session: turn k is sent when turn k−1 has been answered, plus `think`.
#[derive(Debug, Clone)]
pub struct Session {
    /// When the first turn goes out.
    pub start: Duration,
    /// The system prompt shared by the session's turns.
    pub system: String,
    /// The user messages, in order.
    pub turns: Vec<String>,
    /// Output tokens per turn.
    pub output_tokens: u32,
    /// Pause between an answer and the next turn.
    pub think: Duration,
}

/// What a run sends.
#[derive(Debug, Clone)]
pub enum Workload {
    /// Requests at fixed times, whatever the answers.
    Open(Vec<Job>),
    /// Conversations, each turn after the previous answer.
    Sessions(Vec<Session>),
}

impl Workload {
    /// Requests it will send.
    pub fn len(&self) -> usize {
        match self {
            Workload::Open(j) => j.len(),
            Workload::Sessions(s) => s.iter().map(|s| s.turns.len()).sum(),
        }
    }

    /// Whether it sends nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn completion(prompt: Vec<u32>, max_tokens: usize) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens.max(1), "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}})
}

/// A trace replay: arrivals divided by `speedup`, at most `max_requests`, prompts cut to
/// `max_isl` tokens and outputs to `max_osl`, token ids below `vocab`.
pub fn from_trace(t: &[TraceRequest], speedup: f64, max_requests: usize, max_isl: usize, max_osl: usize, vocab: u32) -> Workload {
    let speedup = if speedup > 0.0 { speedup } else { 1.0 };
    Workload::Open(
        t.iter()
            .take(max_requests)
            .map(|r| Job {
                at: Duration::from_secs_f64(r.timestamp as f64 / 1000.0 / speedup),
                path: "/v1/completions",
                body: completion(trace::prompt(r, vocab, max_isl), r.output_length.min(max_osl)),
            })
            .collect(),
    )
}

/// Shared-prefix traffic: `groups` prefixes of `prefix_tokens`, each request one of them
/// (uniformly) plus `suffix_tokens` of its own; Poisson arrivals at `rate` per second.
#[derive(Debug, Clone, Copy)]
pub struct SharedPrefix {
    /// Distinct prefixes.
    pub groups: u32,
    /// Prefix length, tokens.
    pub prefix_tokens: usize,
    /// Unique suffix length, tokens.
    pub suffix_tokens: usize,
    /// Output tokens per request.
    pub output_tokens: usize,
    /// Requests.
    pub requests: usize,
    /// Arrivals per second.
    pub rate: f64,
    /// Token ids are below this.
    pub vocab: u32,
    /// Seed of the arrivals and suffixes.
    pub seed: u64,
}

/// The requests of `w`.
pub fn shared_prefix(w: SharedPrefix) -> Workload {
    let SharedPrefix { groups, prefix_tokens, suffix_tokens, output_tokens, requests, rate, vocab, seed } = w;
    let mut rng = Rng(seed | 1);
    let mut at = 0.0f64;
    let span = u64::from(vocab.max(11) - 10);
    let jobs = (0..requests)
        .map(|_| {
            let g = (rng.next_u64() % u64::from(groups.max(1))) as u32;
            let mut p = Rng(u64::from(g).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let mut prompt: Vec<u32> = (0..prefix_tokens).map(|_| 10 + (p.next_u64() % span) as u32).collect();
            prompt.extend((0..suffix_tokens).map(|_| 10 + (rng.next_u64() % span) as u32));
            // Exponential gaps: -ln(U) / rate.
            let u = ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
            at += -u.ln() / rate.max(1e-9);
            Job { at: Duration::from_secs_f64(at), path: "/v1/completions", body: completion(prompt, output_tokens) }
        })
        .collect();
    Workload::Open(jobs)
}

/// Multi-turn chat: `sessions` conversations of `turns` turns, starting `1/rate` s apart.
#[derive(Debug, Clone, Copy)]
pub struct ChatSessions {
    /// Conversations.
    pub sessions: usize,
    /// User turns per conversation.
    pub turns: usize,
    /// Words per user turn.
    pub words_per_turn: usize,
    /// Words of the system prompt all sessions share.
    pub system_words: usize,
    /// Output tokens per turn.
    pub output_tokens: u32,
    /// Sessions started per second.
    pub rate: f64,
    /// Pause between an answer and the next turn.
    pub think: Duration,
    /// Seed of the texts.
    pub seed: u64,
}

/// The sessions of `c`.
pub fn chat_sessions(c: ChatSessions) -> Workload {
    let ChatSessions { sessions, turns, words_per_turn, system_words, output_tokens, rate, think, seed } = c;
    const WORDS: &[&str] = &["cache", "token", "worker", "prefix", "route", "block", "latency", "stream", "model", "queue", "batch", "decode"];
    let mut rng = Rng(seed | 1);
    let words = |n: usize, rng: &mut Rng| (0..n).map(|_| WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]).collect::<Vec<_>>().join(" ");
    let system = format!("You are a helpful assistant. {}", words(system_words, &mut rng));
    Workload::Sessions(
        (0..sessions)
            .map(|i| Session {
                start: Duration::from_secs_f64(i as f64 / rate.max(1e-9)),
                system: system.clone(),
                turns: (0..turns).map(|t| format!("Turn {t} of conversation {i}: {}", words(words_per_turn, &mut rng))).collect(),
                output_tokens,
                think,
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefix_requests_share_their_groups_prefix_and_arrive_at_the_rate() {
        let w = SharedPrefix { groups: 4, prefix_tokens: 64, suffix_tokens: 8, output_tokens: 5, requests: 2000, rate: 100.0, vocab: 1000, seed: 7 };
        let Workload::Open(jobs) = shared_prefix(w) else { panic!() };
        let prompt = |j: &Job| j.body["prompt"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect::<Vec<_>>();
        let prefixes: std::collections::HashSet<Vec<u64>> = jobs.iter().map(|j| prompt(j)[..64].to_vec()).collect();
        assert_eq!(prefixes.len(), 4);
        assert!(jobs.iter().all(|j| prompt(j).len() == 72));
        let span = jobs.last().unwrap().at.as_secs_f64();
        assert!((span - 20.0).abs() < 2.0, "2000 requests at 100/s take about 20 s: {span}");
        assert!(jobs.windows(2).all(|w| w[0].at <= w[1].at));
    }

    #[test]
    fn a_trace_replay_is_time_scaled_and_capped() {
        let t = vec![
            TraceRequest { timestamp: 0, input_length: 700, output_length: 9, hash_ids: vec![1, 2] },
            TraceRequest { timestamp: 10_000, input_length: 600, output_length: 3000, hash_ids: vec![1, 3] },
        ];
        let Workload::Open(jobs) = from_trace(&t, 10.0, 10, 512, 100, 5000) else { panic!() };
        assert_eq!(jobs[1].at, Duration::from_secs(1));
        assert_eq!(jobs[0].body["prompt"].as_array().unwrap().len(), 512);
        assert_eq!(jobs[1].body["max_tokens"], 100);
        assert_eq!(jobs[0].body["prompt"], jobs[1].body["prompt"], "same first block, cut to it");
    }
}
