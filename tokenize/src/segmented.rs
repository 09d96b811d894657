//! A tokenization cache that exploits what requests share.
//!
//! HF tokenizers split their input on added tokens (`<|im_start|>`, `<｜User｜>`, …) and run
//! normalizer, pre-tokenizer and model on each piece between them independently. A rendered
//! chat prompt is therefore the concatenation of independently tokenized segments, and a
//! multi-turn conversation repeats all earlier segments each turn. [`SegmentCache`] splits the
//! text the same way and tokenizes only segments it has not seen, so turn N costs about one
//! message instead of N. It also stops early once it has the leading tokens routing needs.
//!
//! A long stretch of text with no added token in it (a completion whose prompt is a shared
//! document or instructions followed by a question) would still be one segment, tokenized whole
//! on every request because its tail differs. So a text segment longer than a chunk is cut
//! further, at the first word boundary at least [`CHUNK_BYTES`] after the previous cut: before a
//! space that follows an ASCII letter, digit or punctuation mark and precedes an ASCII letter,
//! where the byte-level BPE pre-tokenizers of GPT-2, Llama 3, Qwen and DeepSeek all split
//! (the space opens the next word's pre-token). Requests sharing a text prefix then share its
//! chunks, only the chunks from where they differ are tokenized, and a request whose routing
//! needs only its first tokens stops after the chunks that hold them.
//!
//! Exactness: ids must equal full tokenization. Splitting is only done on added tokens without
//! strip or single-word flags; and at construction the cache checks itself against full
//! tokenization on probe texts around every added token it splits on. If any probe differs
//! (e.g. a normalizer that rewrites added tokens, or a post-processor that adds tokens), the
//! cache disables itself for that mode and every call falls back to full tokenization.
//! Chunking is checked the same way, on probe texts cut at its boundaries, and is off (segments
//! stay whole) for a tokenizer that does not split there (e.g. one whose normalizer prepends a
//! space marker to every input), that has an added token containing a space, or one that strips
//! the spaces around it or matches whole words only (the text beside it depends on the cut).

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

/// A text segment is cut into chunks of about this many bytes (module doc): small enough that a
/// request re-tokenizes little beyond where it leaves a shared prefix, large enough that a
/// chunk's lookup costs far less than tokenizing it (about 50 tokens of English).
pub const CHUNK_BYTES: usize = 256;

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
    /// Long text segments are cut into chunks (0: they are not).
    chunk_bytes: usize,
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
        Self::with_chunks(tok, capacity, CHUNK_BYTES)
    }

    /// [`SegmentCache::new`] cutting long text segments into chunks of about `chunk_bytes`
    /// (0: never), if the self-check allows it.
    pub fn with_chunks(tok: ModelTokenizer, capacity: usize, chunk_bytes: usize) -> Self {
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
            chunk_bytes: 0,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        };
        s.plain_ok = s.self_check(false);
        s.special_ok = s.self_check(true);
        s.chunk_bytes = if chunk_bytes > 0 && s.chunk_check(chunk_bytes) { chunk_bytes } else { 0 };
        s.segments.lock().clear();
        s
    }

    /// Whether the segmented path is used (`add_special_tokens` false / true).
    pub fn enabled(&self, add_special: bool) -> bool {
        if add_special { self.special_ok } else { self.plain_ok }
    }

    /// Whether long text segments are cut into chunks (the tokenizer passed the chunk check).
    pub fn chunked(&self) -> bool {
        self.chunk_bytes > 0
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
        self.assemble(text, max_tokens, |chunk| self.segment(chunk))
    }

    /// [`SegmentCache::encode`] when every segment it needs is cached already (no tokenizer
    /// work, so it can run on an async worker); `None` when one is not (or the segmented path is
    /// off for this tokenizer), and nothing was tokenized.
    pub fn encode_cached(&self, text: &str, add_special: bool, max_tokens: Option<usize>) -> Option<Vec<u32>> {
        if !self.enabled(add_special) {
            return None;
        }
        self.assemble(text, max_tokens, |chunk| self.cached(chunk).ok_or(())).ok()
    }

    /// The ids of `text`: its added tokens, and each chunk of its text segments as `chunk`
    /// gives them; stops once it has `max_tokens`, or at `chunk`'s first error.
    fn assemble<E>(&self, text: &str, max_tokens: Option<usize>, mut chunk: impl FnMut(&str) -> Result<Arc<[u32]>, E>) -> Result<Vec<u32>, E> {
        let mut out = Vec::new();
        let enough = |out: &[u32]| max_tokens.is_some_and(|m| out.len() >= m);
        'pieces: for piece in self.split(text) {
            match piece {
                Piece::Added(id) => out.push(id),
                Piece::Text(seg) => {
                    for c in chunks(seg, self.chunk_bytes) {
                        out.extend_from_slice(&chunk(c)?);
                        if enough(&out) {
                            break 'pieces;
                        }
                    }
                }
            }
            if enough(&out) {
                break;
            }
        }
        Ok(out)
    }

    /// A segment's ids if they are cached (counted as a hit).
    fn cached(&self, seg: &str) -> Option<Arc<[u32]>> {
        let ids = self.segments.lock().get(&key(seg)).cloned()?;
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some(ids)
    }

    fn segment(&self, seg: &str) -> Result<Arc<[u32]>, String> {
        if let Some(t) = self.cached(seg) {
            return Ok(t);
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let ids: Arc<[u32]> = self.tok.encode(seg, false)?.into();
        let mut m = self.segments.lock();
        if m.len() >= self.capacity {
            m.clear();
        }
        m.insert(key(seg), ids.clone());
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

    /// Whether cutting text at [`word_boundary`]s gives the ids of the uncut text: on every
    /// pair of word endings and word starts the boundary allows, and on long mixed texts cut
    /// into `chunk_bytes` chunks.
    fn chunk_check(&self, chunk_bytes: usize) -> bool {
        if self.tok.any_added_token(|t| t.contains(' ')) || self.tok.has_space_sensitive_added_tokens() {
            return false;
        }
        let ends = ["word", "Word", "x", "12", "7", "a.", "end,", "(x)", "'s", "\"", "é1", "日本z", "a-b", "foo_bar", "$", "?!"];
        let starts = [" w", " word", " The", " x1", " ab's", " a.b", " don't", " z日本", " CamelCase", " a  b", " q\n", " e\u{301}"];
        let mut probes: Vec<(String, usize)> = Vec::new();
        for e in ends {
            for st in starts {
                probes.push((format!("{e}{st}"), e.len()));
                probes.push((format!("lead {e}{st} tail"), 5 + e.len()));
            }
        }
        let whole = |t: &str| self.tok.encode(t, false).ok();
        let pairs_ok = probes.iter().all(|(t, at)| {
            let (a, b) = t.split_at(*at);
            let cut = word_boundary(t.as_bytes(), a.len().max(1)) == Some(*at);
            match (whole(t), whole(a), whole(b)) {
                (Some(full), Some(mut x), Some(y)) => {
                    x.extend(y);
                    cut && full == x
                }
                _ => false,
            }
        });
        let texts = [
            "The cache router sends each request to the worker holding its prefix. It costs 12.5 ms, or 3,000 tokens/s (see docs/routing.md)! Don't re-tokenize: isn't that the point? 日本語 テキスト and émigré café résumé. ",
            "fn main() { let x = vec![1, 2, 3]; println!(\"{x:?}\"); } // a comment with words in it and snake_case names, CamelCase too; [brackets] and {braces} <tags> ",
        ];
        let long_ok = texts.iter().all(|t| {
            let text = t.repeat(1 + 4 * chunk_bytes / t.len());
            let cut: Vec<u32> = chunks(&text, chunk_bytes).flat_map(|c| whole(c).unwrap_or_default()).collect();
            whole(&text).is_some_and(|full| full == cut)
        });
        pairs_ok && long_ok
    }
}

/// The cache's key of a segment: (xxh3 of its text, its length).
fn key(seg: &str) -> (u64, usize) {
    (xxh3_64(seg.as_bytes()), seg.len())
}

/// `seg` cut at the first word boundary at least `step` bytes after each cut (whole when `step`
/// is 0 or it is shorter).
fn chunks(seg: &str, step: usize) -> impl Iterator<Item = &str> {
    let mut rest = seg;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let cut = if step == 0 { None } else { word_boundary(rest.as_bytes(), step) };
        let (head, tail) = rest.split_at(cut.unwrap_or(rest.len()));
        rest = tail;
        Some(head)
    })
}

/// The first word boundary at or after byte `from` of `text`: a space after an ASCII letter,
/// digit or punctuation mark and before an ASCII letter (cut before the space; module doc).
fn word_boundary(text: &[u8], from: usize) -> Option<usize> {
    let start = from.max(1);
    let end = text.len().saturating_sub(1);
    (start..end).find(|&i| text[i] == b' ' && (text[i - 1].is_ascii_alphanumeric() || text[i - 1].is_ascii_punctuation()) && text[i + 1].is_ascii_alphabetic())
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

    /// `n` random words of `random_text`'s kind, no added tokens: one long segment.
    fn long_text(rng: &mut Rng, n: usize) -> String {
        let words = [" the", " cache", " Router", " x", "12", ".", ",", " don't", " 日本", "é", " a", "\n", "  ", "(p)", " CamelCase", " q"];
        (0..n).map(|_| rng.pick(&words)).collect()
    }

    #[test]
    fn long_segments_cut_into_chunks_give_the_ids_of_the_whole() {
        let tok = ModelTokenizer::builtin();
        for chunk in [1, 7, 32, CHUNK_BYTES] {
            let cache = SegmentCache::with_chunks(tok.clone(), 4096, chunk);
            assert!(cache.chunked(), "the shipped tokenizer passes the chunk check");
            let mut rng = Rng(11 + chunk as u64);
            for _ in 0..200 {
                let n = 1 + (rng.next() % 600) as usize;
                let t = long_text(&mut rng, n);
                assert_eq!(cache.encode(&t, false, None).unwrap(), tok.encode(&t, false).unwrap(), "chunk {chunk}: {t:?}");
            }
            for _ in 0..100 {
                let t = random_text(&mut rng).repeat(8);
                assert_eq!(cache.encode(&t, true, None).unwrap(), tok.encode(&t, true).unwrap(), "chunk {chunk}: {t:?}");
            }
        }
    }

    #[test]
    fn texts_sharing_a_long_prefix_tokenize_only_where_they_differ() {
        let tok = ModelTokenizer::builtin();
        let cache = SegmentCache::new(tok.clone(), 4096);
        let mut rng = Rng(5);
        let doc = long_text(&mut rng, 3000);
        let first = format!("{doc} first question about it");
        assert_eq!(cache.encode(&first, false, None).unwrap(), tok.encode(&first, false).unwrap());
        let (_, before) = cache.stats();
        assert!(before > 10, "a long document is many chunks: {before}");
        let second = format!("{doc} and a second one");
        assert_eq!(cache.encode(&second, false, None).unwrap(), tok.encode(&second, false).unwrap());
        let (_, after) = cache.stats();
        assert!(after - before <= 2, "only the chunk where they differ is new: {} misses", after - before);
    }

    #[test]
    fn routing_s_leading_tokens_stop_the_tokenizing_early() {
        let tok = ModelTokenizer::builtin();
        let cache = SegmentCache::new(tok.clone(), 4096);
        let mut rng = Rng(6);
        let doc = long_text(&mut rng, 5000);
        let full = tok.encode(&doc, false).unwrap();
        let head = cache.encode(&doc, false, Some(64)).unwrap();
        assert!(head.len() >= 64 && head.len() < full.len() / 4 && full.starts_with(&head), "{} of {}", head.len(), full.len());
        assert_eq!(cache.encode_cached(&doc, false, Some(64)), Some(head), "and the cached path agrees");
    }

    /// A tokenizer loaded from `json` (written to a temporary file named after `name`).
    fn tokenizer_json(name: &str, json: &str) -> ModelTokenizer {
        let path = std::env::temp_dir().join(format!("kvgate-{name}-{}.json", std::process::id()));
        std::fs::write(&path, json).unwrap();
        let tok = ModelTokenizer::load(&path).unwrap();
        std::fs::remove_file(&path).ok();
        tok
    }

    #[test]
    fn a_tokenizer_that_marks_every_input_s_start_is_not_chunked() {
        // A normalizer that prepends a marker to every input (SentencePiece's legacy style): a
        // chunk tokenized alone would start with a marker the whole text has only once.
        let tok = tokenizer_json(
            "prepend",
            r#"{"version":"1.0","added_tokens":[],"normalizer":{"type":"Prepend","prepend":"_"},"pre_tokenizer":{"type":"WhitespaceSplit"},
            "model":{"type":"WordLevel","vocab":{"_":0,"[UNK]":1,"_hello":2,"world":3,"hello":4,"_world":5},"unk_token":"[UNK]"}}"#,
        );
        assert!(!SegmentCache::new(tok, 64).chunked());
    }

    #[test]
    fn a_tokenizer_with_an_added_token_that_strips_spaces_is_not_chunked() {
        // `<m> The` with rstrip: the whole text gives the space to `<m>`; a chunk starting at
        // " The" would keep it.
        let tok = tokenizer_json(
            "rstrip",
            r#"{"version":"1.0","added_tokens":[{"id":0,"content":"<m>","single_word":false,"lstrip":false,"rstrip":true,"normalized":false,"special":true}],
            "normalizer":null,"pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true},
            "model":{"type":"BPE","vocab":{"<m>":0,"T":1,"h":2,"e":3,"Ġ":4},"merges":[]}}"#,
        );
        assert!(!SegmentCache::new(tok, 64).chunked());
    }

    #[test]
    fn boundaries_are_spaces_between_words() {
        assert_eq!(word_boundary(b"hello world", 1), Some(5));
        assert_eq!(word_boundary(b"hello world", 6), None);
        assert_eq!(word_boundary(b"a  b c", 0), Some(4), "not inside a run of spaces");
        assert_eq!(word_boundary(b"x. 12 y", 0), Some(5), "not before a digit");
        assert_eq!(word_boundary(b"end ", 0), None, "not at the end");
    }
}
