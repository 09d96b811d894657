//! Tokenization CPU per request on a multi-turn chat workload, with and without the segment
//! cache (issue #5), using a real production tokenizer (DeepSeek-V4, vocab 129k). Every
//! request's ids are checked to be identical both ways.
//!
//!   cargo build --release -p kvgate-bench
//!   taskset -c 0 target/release/tokenize-cache [--tokenizer DIR] [--conversations 16] [--turns 12]

use clap::Parser;
use kvgate_bench::Rng;
use kvgate_tokenize::{ModelTokenizer, SegmentCache};
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// HF tokenizer directory.
    #[arg(long, default_value = "../shared/data/tokenizers/deepseek-v4")]
    tokenizer: std::path::PathBuf,
    /// Conversations.
    #[arg(long, default_value_t = 16)]
    conversations: usize,
    /// Turns (user messages) per conversation.
    #[arg(long, default_value_t = 12)]
    turns: usize,
}

const WORDS: &[&str] = &[
    "the",
    "router",
    "cache",
    "prefix",
    "worker",
    "token",
    "latency",
    "throughput",
    "model",
    "request",
    "stream",
    "decode",
    "prefill",
    "gateway",
    "cluster",
    "memory",
    "block",
    "index",
    "policy",
    "schedule",
    "queue",
    "batch",
    "kernel",
    "tensor",
    "attention",
    "layer",
    "network",
    "deploy",
    "config",
    "metric",
    "error",
    "retry",
    "timeout",
    "budget",
    "function",
    "value",
    "return",
    "integer",
    "string",
    "2048",
    "16",
    "0.85",
    "Kubernetes",
    "vLLM",
    "GPU",
    "H100",
    "p99",
    "TTFT",
    "SLO",
    "why",
    "how",
    "what",
    "does",
    "should",
    "could",
];

/// 31 pseudo-random bits as an index (the workload recorded in RESULTS.md).
fn next(rng: &mut Rng) -> usize {
    (rng.next_u64() >> 33) as usize
}

fn message(rng: &mut Rng, words: usize) -> String {
    let mut s = String::new();
    for i in 0..words {
        if i > 0 {
            s.push(if next(rng).is_multiple_of(17) { '\n' } else { ' ' });
        }
        s.push_str(WORDS[next(rng) % WORDS.len()]);
        if next(rng).is_multiple_of(11) {
            s.push(if next(rng).is_multiple_of(2) { '.' } else { ',' });
        }
    }
    s
}

/// DeepSeek's chat format: BOS, system, then `<｜User｜>…<｜Assistant｜>…<｜end▁of▁sentence｜>`.
fn render(system: &str, turns: &[(String, String)], question: &str) -> String {
    let mut s = format!("<｜begin▁of▁sentence｜>{system}");
    for (u, a) in turns {
        s.push_str(&format!("<｜User｜>{u}<｜Assistant｜>{a}<｜end▁of▁sentence｜>"));
    }
    s.push_str(&format!("<｜User｜>{question}<｜Assistant｜>"));
    s
}

fn main() {
    let a = Args::parse();
    let tok = match ModelTokenizer::load(&a.tokenizer) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("tokenize-cache: {e} (pass --tokenizer DIR)");
            std::process::exit(2);
        }
    };
    let cache = SegmentCache::new(tok.clone(), 1 << 16);
    assert!(cache.enabled(false), "the segment cache disabled itself for this tokenizer");
    let mut rng = Rng(2026);
    let system = message(&mut rng, 400); // a shared system prompt
    let mut requests = Vec::new();
    for _ in 0..a.conversations {
        let mut turns: Vec<(String, String)> = Vec::new();
        for _ in 0..a.turns {
            let q = message(&mut rng, 150);
            requests.push(render(&system, &turns, &q));
            let reply = message(&mut rng, 120);
            turns.push((q, reply));
        }
    }
    let (mut full_t, mut cached_t) = (Duration::ZERO, Duration::ZERO);
    let mut tokens = 0usize;
    for text in &requests {
        let t = Instant::now();
        let full = tok.encode(text, false).unwrap();
        full_t += t.elapsed();
        let t = Instant::now();
        let cached = cache.encode(text, false, None).unwrap();
        cached_t += t.elapsed();
        assert_eq!(full, cached, "ids differ");
        tokens += full.len();
    }
    let n = requests.len() as f64;
    let (hits, misses) = cache.stats();
    println!("| workload | requests | mean prompt tokens | full tokenization (ms/request) | with segment cache (ms/request) | CPU ratio |");
    println!("|---|---:|---:|---:|---:|---:|");
    println!(
        "| {} conversations × {} turns, shared 400-word system prompt | {} | {:.0} | {:.3} | {:.3} | {:.1}× less |",
        a.conversations,
        a.turns,
        requests.len(),
        tokens as f64 / n,
        full_t.as_secs_f64() * 1e3 / n,
        cached_t.as_secs_f64() * 1e3 / n,
        full_t.as_secs_f64() / cached_t.as_secs_f64()
    );
    println!("\nsegments: {hits} hits, {misses} misses; ids identical for all {} requests", requests.len());
}
