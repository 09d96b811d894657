//! Workloads: what to send and when. Open-loop request lists (a Mooncake trace replay,
//! synthetic shared-prefix traffic, or a mix of short chat-like prompts and long documents,
//! with Poisson arrivals) and closed-loop multi-turn chat sessions (each turn waits for the
//! previous answer and sends the history back).
//!
//! Synthetic prompts are drawn as token ids or as text ([`PromptFormat`]): text is made of
//! words that are one token each in vllm-sim's built-in tokenizer ([`words`]), so a text prompt
//! has the same length in tokens as its id form there, and every router accepts it (SMG refuses
//! token-id prompts).

use crate::Rng;
use crate::trace::{self, TraceRequest};
use serde_json::{Value, json};
use std::sync::OnceLock;
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

fn completion(prompt: Value, max_tokens: usize) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens.max(1), "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}})
}

/// How synthetic prompts are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptFormat {
    /// Token ids in `[10, vocab)`, sent as a token-id prompt.
    Ids,
    /// Text of one-token words ([`words`]), sent as a string prompt.
    Text,
}

/// Words that are exactly one token each, leading space included (`" cache"`), in vllm-sim's
/// built-in tokenizer, in vocabulary order. A text of n of them is n tokens there: byte-level
/// BPE splits before each space, and each word is its own token.
pub fn words() -> &'static [String] {
    static WORDS: OnceLock<Vec<String>> = OnceLock::new();
    WORDS.get_or_init(|| {
        let tok = kvgate_tokenize::tokenizer::ModelTokenizer::builtin();
        tok.output_vocab()
            .iter()
            .map(|&id| (id, tok.token_text(id)))
            .filter(|(_, t)| t.len() >= 3 && t.starts_with(' ') && t[1..].bytes().all(|b| b.is_ascii_lowercase()))
            .filter(|(id, t)| tok.encode(t, false).is_ok_and(|ids| ids == [*id]))
            .map(|(_, t)| t.to_string())
            .collect()
    })
}

/// A prompt under construction: token ids or text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Token ids.
    Ids(Vec<u32>),
    /// Text, one token per word in the built-in tokenizer.
    Text(String),
}

impl Prompt {
    /// An empty prompt in `format`.
    pub fn new(format: PromptFormat) -> Self {
        match format {
            PromptFormat::Ids => Prompt::Ids(Vec::new()),
            PromptFormat::Text => Prompt::Text(String::new()),
        }
    }

    /// Appends `n` tokens drawn from `rng`: ids in `[10, vocab)`, or words of [`words`].
    pub fn draw(&mut self, rng: &mut Rng, n: usize, vocab: u32) {
        match self {
            Prompt::Ids(ids) => {
                let span = u64::from(vocab.max(11) - 10);
                ids.extend((0..n).map(|_| 10 + (rng.next_u64() % span) as u32));
            }
            Prompt::Text(text) => {
                let w = words();
                for _ in 0..n {
                    text.push_str(&w[(rng.next_u64() % w.len() as u64) as usize]);
                }
            }
        }
    }

    /// Appends `other` (of the same format).
    pub fn extend(&mut self, other: &Prompt) {
        match (self, other) {
            (Prompt::Ids(a), Prompt::Ids(b)) => a.extend_from_slice(b),
            (Prompt::Text(a), Prompt::Text(b)) => a.push_str(b),
            _ => unreachable!("prompts of one workload share a format"),
        }
    }

    /// Its length in tokens (words for text).
    pub fn tokens(&self) -> usize {
        match self {
            Prompt::Ids(ids) => ids.len(),
            Prompt::Text(text) => text.bytes().filter(|&b| b == b' ').count(),
        }
    }

    /// The `prompt` field of a completion request.
    pub fn into_json(self) -> Value {
        match self {
            Prompt::Ids(ids) => json!(ids),
            Prompt::Text(text) => Value::String(text),
        }
    }
}

/// The next exponential gap, seconds, of a Poisson process at `rate` per second.
fn poisson_gap(rng: &mut Rng, rate: f64) -> f64 {
    // -ln(U) / rate, U in (0, 1].
    let u = ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    -u.ln() / rate.max(1e-9)
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
                body: completion(json!(trace::prompt(r, vocab, max_isl)), r.output_length.min(max_osl)),
            })
            .collect(),
    )
}

/// Shared-prefix traffic: `groups` prefixes of `prefix_tokens`, each request one of them
/// (uniformly) plus `suffix_tokens` of its own; Poisson arrivals at `rate` per second.
#[derive(Debug, Clone, Copy)]
pub struct SharedPrefix {
    /// Token ids or text.
    pub format: PromptFormat,
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
    let SharedPrefix { format, groups, prefix_tokens, suffix_tokens, output_tokens, requests, rate, vocab, seed } = w;
    let mut rng = Rng::seeded(seed);
    let mut at = 0.0f64;
    let jobs = (0..requests)
        .map(|_| {
            let g = (rng.next_u64() % u64::from(groups.max(1))) as u32;
            let mut prompt = Prompt::new(format);
            prompt.draw(&mut Rng(u64::from(g).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1), prefix_tokens, vocab);
            prompt.draw(&mut rng, suffix_tokens, vocab);
            at += poisson_gap(&mut rng, rate);
            Job { at: Duration::from_secs_f64(at), path: "/v1/completions", body: completion(prompt.into_json(), output_tokens) }
        })
        .collect();
    Workload::Open(jobs)
}

/// A mix of short chat-like prompts and long documents, open loop with Poisson arrivals.
///
/// Short requests (`1 − long_fraction` of them) continue one of `conversations` ongoing
/// conversations: a system prompt shared by all of them, the conversation's earlier turns, and
/// a new turn, so a conversation's next prompt extends its previous one; a conversation that
/// would outgrow `short_tokens.1` starts over. Long requests ask a question about one of `docs`
/// documents (uniformly): the document, the same for every question about it, and the
/// question, unique; documents are re-asked, so their prefixes can be reused.
#[derive(Debug, Clone, Copy)]
pub struct Mixed {
    /// Token ids or text.
    pub format: PromptFormat,
    /// Requests.
    pub requests: usize,
    /// Arrivals per second.
    pub rate: f64,
    /// Fraction of requests that are long documents.
    pub long_fraction: f64,
    /// Short prompts' length range, tokens (inclusive).
    pub short_tokens: (usize, usize),
    /// Conversations the short requests continue.
    pub conversations: usize,
    /// Documents' length range, tokens (inclusive, question included).
    pub doc_tokens: (usize, usize),
    /// Distinct documents.
    pub docs: u32,
    /// Output tokens per request.
    pub output_tokens: usize,
    /// Token ids are below this.
    pub vocab: u32,
    /// Seed of everything.
    pub seed: u64,
}

/// The requests of `m`.
pub fn mixed(m: Mixed) -> Workload {
    let Mixed { format, requests, rate, long_fraction, short_tokens, conversations, doc_tokens, docs, output_tokens, vocab, seed } = m;
    let (short_min, short_max) = (short_tokens.0.max(1), short_tokens.1.max(short_tokens.0).max(1));
    let (doc_min, doc_max) = (doc_tokens.0.max(1), doc_tokens.1.max(doc_tokens.0).max(1));
    // A system prompt of a fifth of the shortest prompt, and turns sized so that a first turn
    // lands in the range and a conversation grows a few turns before it starts over.
    let system_tokens = short_min / 5;
    let turn = (short_min - system_tokens, ((short_max - short_min) / 4).max(short_min - system_tokens));
    let question = 32.min(doc_min / 2).max(1);
    let uniform = |rng: &mut Rng, (lo, hi): (usize, usize)| lo + (rng.next_u64() % (hi - lo + 1) as u64) as usize;
    let mut rng = Rng::seeded(seed);
    let mut system = Prompt::new(format);
    system.draw(&mut Rng::stream(seed, u64::MAX), system_tokens, vocab);
    let mut convs: Vec<Prompt> = vec![system.clone(); conversations.max(1)];
    let mut at = 0.0f64;
    let jobs = (0..requests)
        .map(|_| {
            at += poisson_gap(&mut rng, rate);
            let long = ((rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < long_fraction;
            let prompt = if long {
                let d = rng.next_u64() % u64::from(docs.max(1));
                let mut doc_rng = Rng::stream(seed, d);
                let len = uniform(&mut doc_rng, (doc_min, doc_max));
                let mut p = Prompt::new(format);
                p.draw(&mut doc_rng, len - question, vocab);
                p.draw(&mut rng, question, vocab);
                p
            } else {
                let c = (rng.next_u64() % convs.len() as u64) as usize;
                let mut next = Prompt::new(format);
                let len = uniform(&mut rng, turn).min(short_max - system_tokens);
                next.draw(&mut rng, len, vocab);
                if convs[c].tokens() + next.tokens() > short_max {
                    convs[c] = system.clone();
                }
                convs[c].extend(&next);
                convs[c].clone()
            };
            Job { at: Duration::from_secs_f64(at), path: "/v1/completions", body: completion(prompt.into_json(), output_tokens) }
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
    let mut rng = Rng::seeded(seed);
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
        let w = SharedPrefix {
            format: PromptFormat::Ids,
            groups: 4,
            prefix_tokens: 64,
            suffix_tokens: 8,
            output_tokens: 5,
            requests: 2000,
            rate: 100.0,
            vocab: 1000,
            seed: 7,
        };
        let Workload::Open(jobs) = shared_prefix(w) else { panic!() };
        let prompt = |j: &Job| j.body["prompt"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect::<Vec<_>>();
        let prefixes: std::collections::HashSet<Vec<u64>> = jobs.iter().map(|j| prompt(j)[..64].to_vec()).collect();
        assert_eq!(prefixes.len(), 4);
        assert!(jobs.iter().all(|j| prompt(j).len() == 72));
        let span = jobs.last().unwrap().at.as_secs_f64();
        assert!((span - 20.0).abs() < 2.0, "2000 requests at 100/s take about 20 s: {span}");
        assert!(jobs.windows(2).all(|w| w[0].at <= w[1].at));
    }

    fn prompt_of(j: &Job) -> Prompt {
        match &j.body["prompt"] {
            Value::String(t) => Prompt::Text(t.clone()),
            Value::Array(a) => Prompt::Ids(a.iter().map(|v| v.as_u64().unwrap() as u32).collect()),
            other => panic!("{other}"),
        }
    }

    fn words_of(p: &Prompt) -> Vec<String> {
        match p {
            Prompt::Text(t) => t.split(' ').skip(1).map(str::to_string).collect(),
            Prompt::Ids(ids) => ids.iter().map(u32::to_string).collect(),
        }
    }

    #[test]
    fn text_prompts_are_one_token_per_word_in_the_builtin_tokenizer() {
        let w = words();
        assert!(w.len() >= 200, "a varied pool: {}", w.len());
        let tok = kvgate_tokenize::tokenizer::ModelTokenizer::builtin();
        let mut p = Prompt::new(PromptFormat::Text);
        p.draw(&mut Rng(3), 500, 0);
        assert_eq!(p.tokens(), 500);
        let Prompt::Text(text) = &p else { panic!() };
        assert_eq!(tok.encode(text, false).unwrap().len(), 500);
        // A shared text prefix is a shared token prefix.
        let mut q = p.clone();
        q.draw(&mut Rng(4), 20, 0);
        let Prompt::Text(longer) = &q else { panic!() };
        let (a, b) = (tok.encode(text, false).unwrap(), tok.encode(longer, false).unwrap());
        assert_eq!(a[..], b[..500]);
    }

    #[test]
    fn shared_prefix_text_keeps_the_groups_and_lengths() {
        let w = SharedPrefix {
            format: PromptFormat::Text,
            groups: 32,
            prefix_tokens: 384,
            suffix_tokens: 128,
            output_tokens: 8,
            requests: 600,
            rate: 50.0,
            vocab: 4000,
            seed: 42,
        };
        let Workload::Open(jobs) = shared_prefix(w) else { panic!() };
        let prompts: Vec<Vec<String>> = jobs.iter().map(|j| words_of(&prompt_of(j))).collect();
        assert!(prompts.iter().all(|p| p.len() == 512));
        let prefixes: std::collections::HashSet<&[String]> = prompts.iter().map(|p| &p[..384]).collect();
        assert_eq!(prefixes.len(), 32, "every group shows up in 600 requests");
        let suffixes: std::collections::HashSet<&[String]> = prompts.iter().map(|p| &p[384..]).collect();
        assert_eq!(suffixes.len(), 600, "suffixes are unique");
        let Workload::Open(again) = shared_prefix(w) else { panic!() };
        assert!(jobs.iter().zip(&again).all(|(a, b)| a.body == b.body && a.at == b.at), "deterministic");
        let Workload::Open(other) = shared_prefix(SharedPrefix { seed: 43, ..w }) else { panic!() };
        assert_ne!(jobs[0].body, other[0].body);
    }

    fn mixed_default(format: PromptFormat, seed: u64) -> Mixed {
        Mixed {
            format,
            requests: 2000,
            rate: 20.0,
            long_fraction: 0.2,
            short_tokens: (100, 500),
            conversations: 32,
            doc_tokens: (4096, 16384),
            docs: 24,
            output_tokens: 64,
            vocab: 4000,
            seed,
        }
    }

    #[test]
    fn mixed_has_the_proportions_sizes_and_reuse_asked_for() {
        for format in [PromptFormat::Ids, PromptFormat::Text] {
            let Workload::Open(jobs) = mixed(mixed_default(format, 42)) else { panic!() };
            assert_eq!(jobs.len(), 2000);
            let prompts: Vec<Vec<String>> = jobs.iter().map(|j| words_of(&prompt_of(j))).collect();
            let (long, short): (Vec<&Vec<String>>, Vec<&Vec<String>>) = prompts.iter().partition(|p| p.len() >= 4096);
            assert!(short.iter().all(|p| (100..=500).contains(&p.len())), "{format:?}: short prompts of 100-500 tokens");
            assert!(long.iter().all(|p| (4096..=16384).contains(&p.len())), "{format:?}: documents of 4k-16k tokens");
            let frac = long.len() as f64 / 2000.0;
            assert!((frac - 0.2).abs() < 0.03, "{format:?}: long fraction {frac}");
            // Short prompts span the range.
            assert!(short.iter().any(|p| p.len() < 150) && short.iter().any(|p| p.len() > 400));
            // Documents are re-asked: 24 distinct documents (first 4,000 tokens), questions unique.
            let docs: std::collections::HashSet<&[String]> = long.iter().map(|p| &p[..4000]).collect();
            assert_eq!(docs.len(), 24, "{format:?}");
            let asked: std::collections::HashSet<&Vec<String>> = long.iter().copied().collect();
            assert_eq!(asked.len(), long.len(), "each question is unique");
            // Short prompts share the system prompt, and conversations extend earlier prompts.
            let system = &short[0][..20];
            assert!(short.iter().all(|p| &p[..20] == system));
            let extended = short.windows(2).filter(|w| w[1].len() > w[0].len()).count();
            let continued = short.iter().enumerate().filter(|(i, p)| short[..*i].iter().any(|q| q.len() < p.len() && p.starts_with(q))).count();
            assert!(extended > 0 && continued > short.len() / 2, "{format:?}: most short prompts continue a conversation ({continued})");
            // Poisson at 20/s: 2,000 requests in about 100 s, in order.
            let span = jobs.last().unwrap().at.as_secs_f64();
            assert!((span - 100.0).abs() < 10.0, "{span}");
            assert!(jobs.windows(2).all(|w| w[0].at <= w[1].at));
        }
        let Workload::Open(a) = mixed(mixed_default(PromptFormat::Text, 7)) else { panic!() };
        let Workload::Open(b) = mixed(mixed_default(PromptFormat::Text, 7)) else { panic!() };
        let Workload::Open(c) = mixed(mixed_default(PromptFormat::Text, 8)) else { panic!() };
        assert!(a.iter().zip(&b).all(|(x, y)| x.body == y.body && x.at == y.at), "same seed, same workload");
        assert!(a.iter().zip(&c).any(|(x, y)| x.body != y.body), "another seed, another workload");
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
