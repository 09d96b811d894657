//! A tokenization cache that exploits what requests share.
//!
//! HF tokenizers split their input on added tokens (`<|im_start|>`, `<｜User｜>`, …) and run
//! normalizer, pre-tokenizer and model on each piece between them independently. A rendered
//! chat prompt is therefore the concatenation of independently tokenized segments, and a
//! multi-turn conversation repeats all earlier segments each turn. [`SegmentCache`] splits the
//! text the same way and tokenizes only segments it has not seen, so turn N costs about one
//! message instead of N. It also stops early once it has the leading tokens routing needs.
//!
//! Exactness: ids must equal full tokenization. Splitting is only done on added tokens without
//! strip or single-word flags; and at construction the cache checks itself against full
//! tokenization on probe texts around every added token it splits on. If any probe differs
//! (e.g. a normalizer that rewrites added tokens, or a post-processor that adds tokens), the
//! cache disables itself for that mode and every call falls back to full tokenization.

use crate::tokenizer::ModelTokenizer;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use xxhash_rust::xxh3::xxh3_64;

/// Cached segments by (xxh3 of the text, its length).
type SegmentMap = HashMap<(u64, usize), Arc<[u32]>>;

/// Most cached segments; beyond it the cache is emptied (bounded memory).
pub const DEFAULT_CAPACITY: usize = 65_536;

/// The cache.
pub struct SegmentCache {
    tok: ModelTokenizer,
    /// Added tokens to split on, by first char, longest first.
    splitters: HashMap<char, Vec<(String, u32)>>,
    /// First bytes of those tokens: the scan only looks closer at these.
    first_bytes: [bool; 256],
    segments: Mutex<SegmentMap>,
    capacity: usize,
    plain_ok: bool,
    special_ok: bool,
    hits: AtomicU64,
    misses: AtomicU64,
}

enum Piece<'a> {
    Text(&'a str),
    Added(u32),
}

impl SegmentCache {
    /// A cache over `tok`, holding at most `capacity` segments. Runs the self-check.
    pub fn new(tok: ModelTokenizer, capacity: usize) -> Self {
        let mut splitters: HashMap<char, Vec<(String, u32)>> = HashMap::new();
        for (id, content) in tok.splittable_added_tokens() {
            if let Some(c) = content.chars().next() {
                splitters.entry(c).or_default().push((content, id));
            }
        }
        let mut first_bytes = [false; 256];
        for v in splitters.values_mut() {
            v.sort_by_key(|(content, _)| std::cmp::Reverse(content.len()));
            for (content, _) in v.iter() {
                first_bytes[content.as_bytes()[0] as usize] = true;
            }
        }
        let mut s = Self {
            tok,
            splitters,
            first_bytes,
            segments: Mutex::new(HashMap::new()),
            capacity: capacity.max(1),
            plain_ok: true,
            special_ok: true,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        };
        s.plain_ok = s.self_check(false);
        s.special_ok = s.self_check(true);
        s.segments.lock().clear();
        s
    }

    /// Whether the segmented path is used (`add_special_tokens` false / true).
    pub fn enabled(&self, add_special: bool) -> bool {
        if add_special { self.special_ok } else { self.plain_ok }
    }

    /// Segments served from the cache / tokenized.
    pub fn stats(&self) -> (u64, u64) {
        (self.hits.load(Ordering::Relaxed), self.misses.load(Ordering::Relaxed))
    }

    /// The underlying tokenizer.
    pub fn tokenizer(&self) -> &ModelTokenizer {
        &self.tok
    }

    /// Token ids of `text`, identical to full tokenization. With `max_tokens`, at least that many
    /// leading tokens (or all) are returned, and later segments are not tokenized.
    pub fn encode(&self, text: &str, add_special: bool, max_tokens: Option<usize>) -> Result<Vec<u32>, String> {
        if !self.enabled(add_special) {
            return self.tok.encode(text, add_special);
        }
        let mut out = Vec::new();
        for piece in self.split(text) {
            match piece {
                Piece::Added(id) => out.push(id),
                Piece::Text(seg) => out.extend_from_slice(&self.segment(seg)?),
            }
            if max_tokens.is_some_and(|m| out.len() >= m) {
                break;
            }
        }
        Ok(out)
    }

    /// [`SegmentCache::encode`] when every segment it needs is cached already (no tokenizer
    /// work, so it can run on an async worker); `None` when one is not (or the segmented path is
    /// off for this tokenizer), and nothing was tokenized.
    pub fn encode_cached(&self, text: &str, add_special: bool, max_tokens: Option<usize>) -> Option<Vec<u32>> {
        if !self.enabled(add_special) {
            return None;
        }
        let mut out = Vec::new();
        for piece in self.split(text) {
            match piece {
                Piece::Added(id) => out.push(id),
                Piece::Text(seg) => {
                    let key = (xxh3_64(seg.as_bytes()), seg.len());
                    let ids = self.segments.lock().get(&key).cloned()?;
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    out.extend_from_slice(&ids);
                }
            }
            if max_tokens.is_some_and(|m| out.len() >= m) {
                break;
            }
        }
        Some(out)
    }

    fn segment(&self, seg: &str) -> Result<Arc<[u32]>, String> {
        let key = (xxh3_64(seg.as_bytes()), seg.len());
        if let Some(t) = self.segments.lock().get(&key) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(t.clone());
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let ids: Arc<[u32]> = self.tok.encode(seg, false)?.into();
        let mut m = self.segments.lock();
        if m.len() >= self.capacity {
            m.clear();
        }
        m.insert(key, ids.clone());
        Ok(ids)
    }

    fn split<'a>(&self, text: &'a str) -> Vec<Piece<'a>> {
        let mut out = Vec::new();
        let mut start = 0;
        let mut i = 0;
        let raw = text.as_bytes();
        let bytes = raw.len();
        while i < bytes {
            // Cheap byte test first; a token's first byte is always a char boundary.
            if !self.first_bytes[raw[i] as usize] || !text.is_char_boundary(i) {
                i += 1;
                continue;
            }
            let c = text[i..].chars().next().expect("in bounds");
            if let Some(cands) = self.splitters.get(&c)
                && let Some((content, id)) = cands.iter().find(|(s, _)| text[i..].starts_with(s.as_str()))
            {
                if i > start {
                    out.push(Piece::Text(&text[start..i]));
                }
                out.push(Piece::Added(*id));
                i += content.len();
                start = i;
                continue;
            }
            i += c.len_utf8();
        }
        if start < bytes {
            out.push(Piece::Text(&text[start..]));
        }
        out
    }

    /// Compares the segmented path with full tokenization on probe texts around every added
    /// token used for splitting (a sample when there are many).
    fn self_check(&self, add_special: bool) -> bool {
        let mut specials: Vec<&str> = self.splitters.values().flatten().map(|(s, _)| s.as_str()).collect();
        specials.sort_unstable();
        let step = (specials.len() / 64).max(1);
        let fillers = ["", " ", "hello world", " leading", "trailing ", "\n", "\n\n x", "12345 678", "日本語 テキスト", "a.b,c!", "  two  spaces"];
        let mut probes: Vec<String> = fillers.iter().map(|f| f.to_string()).collect();
        for s in specials.iter().step_by(step) {
            for (a, b) in fillers.iter().zip(fillers.iter().rev()) {
                probes.push(format!("{a}{s}{b}"));
                probes.push(format!("{s}{a}{s}{b}"));
            }
        }
        let ok = probes.iter().all(|p| {
            let full = self.tok.encode(p, add_special);
            let seg: Result<Vec<u32>, String> = (|| {
                let mut out = Vec::new();
                for piece in self.split(p) {
                    match piece {
                        Piece::Added(id) => out.push(id),
                        Piece::Text(t) => out.extend_from_slice(&self.tok.encode(t, false)?),
                    }
                }
                Ok(out)
            })();
            full.is_ok() && full == seg
        });
        if !ok {
            // No tracing dependency here: the caller reports `enabled() == false`.
            return false;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ChatInput;
    use serde_json::json;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn pick<'a>(&mut self, v: &[&'a str]) -> &'a str {
            v[(self.next() % v.len() as u64) as usize]
        }
    }

    fn random_text(rng: &mut Rng) -> String {
        let parts = [
            "the",
            " cache",
            " router",
            "  ",
            "\n",
            "\t",
            "é",
            "日本",
            "12",
            "345",
            "!",
            "?",
            ".",
            "<|im_start|>",
            "<|im_end|>",
            "<|endoftext|>",
            " spaced ",
            "CamelCase",
            "snake_case",
            "🙂",
            "x",
            "\r\n",
            "'s",
            " don't",
        ];
        let n = 1 + rng.next() % 40;
        (0..n).map(|_| rng.pick(&parts)).collect()
    }

    #[test]
    fn multi_turn_chat_ids_equal_full_tokenization() {
        let tok = ModelTokenizer::builtin();
        let cache = SegmentCache::new(tok.clone(), 1024);
        assert!(cache.enabled(false), "the shipped tokenizer passes the self-check");
        let mut rng = Rng(99);
        for conv in 0..60 {
            let mut msgs = Vec::new();
            for turn in 0..8 {
                msgs.push(json!({"role": if turn % 2 == 0 { "user" } else { "assistant" }, "content": random_text(&mut rng)}));
                let text = tok.render_chat(&ChatInput { messages: &msgs, add_generation_prompt: true, tools: None, kwargs: None }).unwrap();
                let full = tok.encode(&text, false).unwrap();
                let cached = cache.encode(&text, false, None).unwrap();
                assert_eq!(cached, full, "conversation {conv} turn {turn}: {text:?}");
                let head = cache.encode(&text, false, Some(10)).unwrap();
                assert!(head.len() >= 10.min(full.len()) && full.starts_with(&head), "a prefix of the full ids");
            }
        }
        let (hits, misses) = cache.stats();
        assert!(hits > misses, "earlier turns' segments are reused: {hits} hits, {misses} misses");
    }

    #[test]
    fn the_cached_only_path_answers_exactly_when_every_segment_is_cached() {
        let tok = ModelTokenizer::builtin();
        let cache = SegmentCache::new(tok.clone(), 1024);
        let text = "<|im_start|>user\nsummarize the report<|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(cache.encode_cached(text, false, None), None, "nothing cached yet");
        let (_, misses) = cache.stats();
        assert_eq!(cache.stats().1, misses, "and nothing was tokenized");
        let full = cache.encode(text, false, None).unwrap();
        assert_eq!(cache.encode_cached(text, false, None), Some(full.clone()));
        assert_eq!(cache.encode_cached(text, false, Some(3)).map(|v| full.starts_with(&v)), Some(true));
        let longer = format!("{text}and one more segment<|im_end|>");
        assert_eq!(cache.encode_cached(&longer, false, None), None, "a new segment is a miss");
    }

    #[test]
    fn plain_random_text_is_identical_too() {
        let tok = ModelTokenizer::builtin();
        let cache = SegmentCache::new(tok.clone(), 64);
        let mut rng = Rng(7);
        for _ in 0..500 {
            let t = random_text(&mut rng);
            assert_eq!(cache.encode(&t, false, None).unwrap(), tok.encode(&t, false).unwrap(), "{t:?}");
            assert_eq!(cache.encode(&t, true, None).unwrap(), tok.encode(&t, true).unwrap(), "{t:?}");
        }
    }
}
