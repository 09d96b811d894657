//! Tokenization CPU per request with and without the segment cache, using a
//! real production tokenizer (DeepSeek-V4, vocab 129k), on two workloads: multi-turn chat (the
//! segments between added tokens repeat) and completions whose text prompts share a long
//! document (one segment, reused only when cut into chunks). Every request's ids are checked to
//! be identical every way.
//!
//!   cargo build --release -p kvgate-bench
//!   taskset -c 0 target/release/tokenize-cache [--tokenizer DIR] [--conversations 16] [--turns 12]

use clap::Parser;
use kvgate_bench::Rng;
use kvgate_tokenize::{ModelTokenizer, SegmentCache};
use std::fmt::Write as _;
use std::time::Instant;

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
    /// Documents the completions ask about.
    #[arg(long, default_value_t = 16)]
    docs: usize,
    /// Words per document.
    #[arg(long, default_value_t = 2000)]
    doc_words: usize,
    /// Questions per document.
    #[arg(long, default_value_t = 12)]
    questions: usize,
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

/// 31 pseudo-random bits as an index; the workload depends on exactly these bits.
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
        let _ = write!(s, "<｜User｜>{u}<｜Assistant｜>{a}<｜end▁of▁sentence｜>");
    }
    let _ = write!(s, "<｜User｜>{question}<｜Assistant｜>");
    s
}

/// Milliseconds per request tokenizing `requests` with `encode`, and the ids it gave.
fn timed(requests: &[String], encode: impl Fn(&str) -> Vec<u32>) -> (f64, Vec<Vec<u32>>) {
    let t = Instant::now();
    let ids: Vec<Vec<u32>> = requests.iter().map(|r| encode(r)).collect();
    (t.elapsed().as_secs_f64() * 1e3 / requests.len() as f64, ids)
}

/// One table row: full tokenization against the segment cache with whole segments and with
/// chunks, each cache fresh; panics if any request's ids differ.
fn row(tok: &ModelTokenizer, name: &str, requests: &[String]) {
    let (full_ms, full) = timed(requests, |t| tok.encode(t, false).unwrap());
    let whole = SegmentCache::with_chunks(tok.clone(), 1 << 16, 0);
    let chunked = SegmentCache::new(tok.clone(), 1 << 16);
    assert!(whole.enabled(false), "the segment cache disabled itself for this tokenizer");
    assert!(chunked.chunked(), "chunking disabled itself for this tokenizer");
    let (whole_ms, a) = timed(requests, |t| whole.encode(t, false, None).unwrap());
    let (chunked_ms, b) = timed(requests, |t| chunked.encode(t, false, None).unwrap());
    assert!(a == full && b == full, "{name}: ids differ from full tokenization");
    let tokens = full.iter().map(Vec::len).sum::<usize>() as f64 / requests.len() as f64;
    let (hits, misses) = chunked.stats();
    println!(
        "| {name} | {} | {tokens:.0} | {full_ms:.3} | {whole_ms:.3} ({:.1}× less) | {chunked_ms:.3} ({:.1}× less) | {hits} / {misses} |",
        requests.len(),
        full_ms / whole_ms,
        full_ms / chunked_ms
    );
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
    let mut rng = Rng(2026);
    let system = message(&mut rng, 400); // a shared system prompt
    let mut chat = Vec::new();
    for _ in 0..a.conversations {
        let mut turns: Vec<(String, String)> = Vec::new();
        for _ in 0..a.turns {
            let q = message(&mut rng, 150);
            chat.push(render(&system, &turns, &q));
            let reply = message(&mut rng, 120);
            turns.push((q, reply));
        }
    }
    let docs: Vec<String> = (0..a.docs).map(|_| message(&mut rng, a.doc_words)).collect();
    let mut completions = Vec::new();
    for _ in 0..a.questions {
        for d in &docs {
            completions.push(format!("{d}\n\nQuestion: {}\nAnswer:", message(&mut rng, 40)));
        }
    }
    println!(
        "| workload | requests | mean prompt tokens | full tokenization (ms/request) | segment cache, whole segments | segment cache, chunks | chunk hits / misses |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    row(&tok, &format!("{} conversations × {} turns, shared 400-word system prompt", a.conversations, a.turns), &chat);
    row(&tok, &format!("{} documents of {} words × {} questions, text completions", a.docs, a.doc_words, a.questions), &completions);
    println!("\nids identical to full tokenization for every request");
}
