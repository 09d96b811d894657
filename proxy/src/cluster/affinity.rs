//! Stored responses shared between replicas (docs/replicas.md, "Affinity"): which worker
//! stored each Responses-API response, in a JetStream key-value bucket whose entries expire
//! after `affinity_ttl_s`. Every replica watches the bucket and keeps what it learns in its own
//! map (`fleet::StoredResponses`), so a conversation's next turn is placed from memory, never
//! by a lookup on the request path.

/// The bucket key of response `id`: the id itself when it is a plain token (OpenAI's and
/// vLLM's ids are), else `h.` and its bytes in hex (keys allow only letters, digits and
/// `-_=/.`).
pub fn key(id: &str) -> String {
    if !id.is_empty() && id.len() <= 256 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
        return id.to_string();
    }
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut k = String::with_capacity(2 + 2 * id.len());
    k.push_str("h.");
    for b in id.bytes() {
        k.push(char::from(HEX[usize::from(b >> 4)]));
        k.push(char::from(HEX[usize::from(b & 15)]));
    }
    k
}

/// The response id a bucket key stands for ([`key`] undone); `None` for a key no replica
/// writes.
pub fn id(key: &str) -> Option<String> {
    let Some(hex) = key.strip_prefix("h.") else { return Some(key.to_string()) };
    if hex.len() % 2 != 0 {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok()).collect();
    String::from_utf8(bytes?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_id_has_a_key_and_comes_back_from_it() {
        for rid in ["resp_0123abcd", "chatcmpl-x_y", "a.b c/ü", "h.41"] {
            let k = key(rid);
            assert!(k.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_=/.".contains(&b)), "{k}");
            assert_eq!(id(&k).as_deref(), Some(rid), "{k}");
        }
        assert_eq!(key("resp_1"), "resp_1");
        assert_eq!(id("h.4"), None);
    }
}
