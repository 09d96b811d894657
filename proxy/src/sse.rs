//! Counting generated tokens in a worker's Server-Sent Events stream, for output-block
//! tracking. vLLM sends one `data:` event per generated token (per choice); the end marker
//! `data: [DONE]`, the usage-only chunk (`"choices":[]`) and chat's opening role chunk
//! (`"role":"assistant"`, the only one naming a role) carry none. JSON escapes quotes inside
//! strings, so generated text can never look like either marker. Events may be split
//! across body chunks, so the unfinished line is carried over, up to a small cap: a longer
//! line is still a token event, and its start is enough to tell.

// Parses bytes from outside: a narrowing cast here could truncate a peer's value.
#![deny(clippy::cast_possible_truncation)]

/// Longest line prefix kept between chunks; the markers that matter sit at the start.
const MAX_CARRY: usize = 4096;

/// Counts token events across the chunks of one stream.
#[derive(Debug, Default)]
pub struct SseEventCounter {
    carry: Vec<u8>,
}

impl SseEventCounter {
    /// Token events completed by `chunk`.
    pub fn feed(&mut self, chunk: &[u8]) -> u64 {
        let mut n = 0;
        let mut rest = chunk;
        while let Some(i) = memchr::memchr(b'\n', rest) {
            let line = &rest[..i];
            n += if self.carry.is_empty() {
                u64::from(is_token_event(line))
            } else {
                self.keep(line);
                let whole = std::mem::take(&mut self.carry);
                u64::from(is_token_event(&whole))
            };
            rest = &rest[i + 1..];
        }
        self.keep(rest);
        n
    }

    fn keep(&mut self, part: &[u8]) {
        let room = MAX_CARRY.saturating_sub(self.carry.len());
        self.carry.extend_from_slice(&part[..part.len().min(room)]);
    }
}

fn is_token_event(line: &[u8]) -> bool {
    use memchr::memmem::Finder;
    use std::sync::LazyLock;
    // Built once: building a searcher costs more than searching one event.
    static NO_CHOICES: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"choices\":[]"));
    static ROLE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"role\":"));
    let Some(data) = line.strip_prefix(b"data:") else { return false };
    let data = data.trim_ascii_start();
    !data.starts_with(b"[DONE]") && NO_CHOICES.find(data).is_none() && ROLE.find(data).is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &[u8] = b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n\
data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"text\":\"b\"}]}\n\n\
data: {\"id\":\"x\",\"choices\":[],\"usage\":{\"completion_tokens\":2}}\n\ndata: [DONE]\n\n";

    #[test]
    fn counts_token_events_only() {
        assert_eq!(SseEventCounter::default().feed(STREAM), 2);
    }

    #[test]
    fn any_split_into_chunks_counts_the_same() {
        for cut in 0..STREAM.len() {
            for cut2 in cut..STREAM.len() {
                let mut c = SseEventCounter::default();
                let n = c.feed(&STREAM[..cut]) + c.feed(&STREAM[cut..cut2]) + c.feed(&STREAM[cut2..]);
                assert_eq!(n, 2, "cuts at {cut}, {cut2}");
            }
        }
    }

    #[test]
    fn comments_and_other_fields_are_not_tokens_and_long_lines_are_bounded() {
        let mut c = SseEventCounter::default();
        assert_eq!(c.feed(b": keep-alive\n\nevent: x\nid: 3\n\n"), 0);
        let long = [b"data: {\"choices\":[{\"text\":\"".as_slice(), &vec![b'z'; 100_000], b"\"}]}\n"].concat();
        assert_eq!(long.chunks(1000).map(|part| c.feed(part)).sum::<u64>(), 1);
        assert!(c.carry.is_empty());
        assert_eq!(c.feed(&long), 1);
    }
}
