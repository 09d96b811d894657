//! A JSON list of token ids read straight from the bytes: a long prompt's ids arrive as one
//! (the request's `prompt`, the first event's `prompt_token_ids`), tens of KiB of digits that
//! a JSON parser read at several times this reader's cost.
//!
//! Only the plain form is read: `[`, then ids each `0` or `[1-9][0-9]*` up to `u32::MAX`,
//! separated by commas, then `]`, with JSON whitespace anywhere between. Any other list (a sign,
//! a fraction, an exponent, a leading zero, a larger number, anything nested) is `None`, for a
//! JSON parser to judge; a list read here is one serde_json reads as the same `Vec<u32>`.

/// The list of ids starting at `at` (after any whitespace) in `b`, and the index just past its
/// `]`; `None` when the value there is not such a list.
pub fn read(b: &[u8], at: usize) -> Option<(Vec<u32>, usize)> {
    let mut i = skip_ws(b, at);
    if b.get(i) != Some(&b'[') {
        return None;
    }
    i = skip_ws(b, i + 1);
    let mut ids = Vec::new();
    if b.get(i) == Some(&b']') {
        return Some((ids, i + 1));
    }
    loop {
        let (id, end) = id(b, i)?;
        ids.push(id);
        i = skip_ws(b, end);
        match b.get(i)? {
            b',' => i = skip_ws(b, i + 1),
            b']' => return Some((ids, i + 1)),
            _ => return None,
        }
    }
}

/// [`read`], or `null` (`Some((None, end))`).
pub fn read_nullable(b: &[u8], at: usize) -> Option<(Option<Vec<u32>>, usize)> {
    let at = skip_ws(b, at);
    if b[at.min(b.len())..].starts_with(b"null") {
        return Some((None, at + 4));
    }
    read(b, at).map(|(ids, end)| (Some(ids), end))
}

/// The index of the first byte at or after `i` that is not JSON whitespace.
pub fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while b.get(i).is_some_and(|c| matches!(c, b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

const ONES: u64 = 0x0101_0101_0101_0101;

/// The id at `i` and the index just past its digits. Eight bytes are looked at in one word:
/// where the digits end and what they are worth come from a few word operations instead of
/// a branch per digit, whose mispredictions dominated a byte loop's cost per id.
fn id(b: &[u8], i: usize) -> Option<(u32, usize)> {
    let word = match b.get(i..i + 8) {
        Some(w) => w.try_into().unwrap_or([b' '; 8]),
        // The list's last bytes: padded with a non-digit.
        None => {
            let mut w = [b' '; 8];
            let tail = b.get(i..).unwrap_or_default();
            w[..tail.len()].copy_from_slice(tail);
            w
        }
    };
    // Each byte minus '0': a digit is 0..=9, a non-digit has a high nibble or is 10..=15, which
    // adding 6 shows as a high nibble. A byte below '0' borrows from the byte after it in the
    // subtraction, and one above 0xF9 carries into the byte after it in the addition: both only
    // reach bytes after the first non-digit, and only the bytes before it are used.
    let d = u64::from_le_bytes(word).wrapping_sub(ONES * u64::from(b'0'));
    let non_digit = (d.wrapping_add(ONES * 6) | d) & (ONES * 0xF0);
    let len = (non_digit.trailing_zeros() / 8) as usize;
    if len == 0 || (len > 1 && b[i] == b'0') {
        return None;
    }
    let mut n = value(d << (8 * (8 - len)));
    let mut end = i + len;
    // Nine or ten digits (u32 ids up to 4,294,967,295): the rest one by one.
    while let Some(&c) = b.get(end).filter(|c| c.is_ascii_digit()) {
        if end - i == 10 {
            return None;
        }
        n = n * 10 + u64::from(c - b'0');
        end += 1;
    }
    Some((u32::try_from(n).ok()?, end))
}

/// The number whose decimal digits are the eight bytes of `d`, most significant in the lowest
/// byte (leading zeros for shorter numbers): pairs, then quads, then the whole, each step one
/// multiply.
fn value(d: u64) -> u64 {
    let d = (d.wrapping_mul(10 * 256 + 1) >> 8) & 0x00FF_00FF_00FF_00FF;
    let d = (d.wrapping_mul(100 * 65_536 + 1) >> 16) & 0x0000_FFFF_0000_FFFF;
    d.wrapping_mul(10_000 * (1 << 32) + 1) >> 32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serde(s: &str) -> Option<Vec<u32>> {
        serde_json::from_str(s).ok()
    }

    #[test]
    fn plain_lists_are_read_as_serde_json_reads_them() {
        for s in ["[1,2,3]", "[]", "[ ]", " [ 0 , 4294967295 ]", "[\n12345678,\t123456789,1234567890 ]", "[7]", "[99999999,100000000,10,9,0]"] {
            let (ids, end) = read(s.as_bytes(), 0).unwrap_or_else(|| panic!("not read: {s}"));
            assert_eq!(Some(ids), serde(s), "{s}");
            assert_eq!(end, s.len(), "{s}");
        }
        // The index past the list, in a longer text.
        assert_eq!(read(b"{\"p\": [5, 6] , \"q\":1}", 5), Some((vec![5, 6], 12)));
        assert_eq!(read_nullable(b" null ,", 0), Some((None, 5)));
        assert_eq!(read_nullable(b"[3]", 0), Some((Some(vec![3]), 3)));
        assert_eq!(read_nullable(b"nul", 0), None);
        assert_eq!(read_nullable(b"", 0), None);
    }

    #[test]
    fn anything_else_is_left_to_a_parser() {
        for s in [
            "[1,2.0]",
            "[-1]",
            "[-0]",
            "[01]",
            "[00]",
            "[4294967296]",
            "[12345678901]",
            "[1,]",
            "[,1]",
            "[1 2]",
            "[[1]]",
            "[\"1\"]",
            "[1e2]",
            "[1E2]",
            "null",
            "7",
            "[1",
            "[",
            "",
            "[1,2",
            "[+1]",
        ] {
            assert_eq!(read(s.as_bytes(), 0), None, "{s}");
        }
    }

    /// Lists of random ids of every length, with random whitespace, and lists damaged by a byte:
    /// whatever is read here, serde_json reads the same.
    #[test]
    fn random_lists_agree_with_serde_json() {
        let mut next = crate::hash::sequence(9);
        let ws = [" ", "", "", "\n", "\t", "  "];
        let mut read_here = 0;
        for _ in 0..20_000 {
            let n = next() % 20;
            let ids: Vec<u32> = (0..n).map(|_| (next() >> (next() % 64)) as u32).collect();
            let mut s = String::from("[");
            for (k, id) in ids.iter().enumerate() {
                s.push_str(ws[(next() % 6) as usize]);
                s.push_str(&id.to_string());
                s.push_str(ws[(next() % 6) as usize]);
                if k + 1 < ids.len() {
                    s.push(',');
                }
            }
            s.push(']');
            assert_eq!(read(s.as_bytes(), 0).map(|r| r.0), Some(ids), "{s}");
            let mut damaged = s.into_bytes();
            let at = (next() % damaged.len() as u64) as usize;
            damaged[at] = b"0123456789,[]-. e"[(next() % 17) as usize];
            let text = String::from_utf8(damaged).unwrap();
            if let Some((ids, end)) = read(text.as_bytes(), 0) {
                read_here += 1;
                assert_eq!(Some(ids), serde(&text[..end]), "{text}");
            }
        }
        assert!(read_here > 5_000, "{read_here}");
    }
}
