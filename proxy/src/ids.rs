//! Fresh ids: request ids, stored-response ids, a gateway's instance id. The bits come from
//! the clock mixed with a process-wide count, so two ids made in the same nanosecond differ.

use std::sync::atomic::{AtomicU64, Ordering};

/// 64 fresh bits for an id.
pub fn fresh_bits() -> u64 {
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    kvgate_kv::hash::mix(t ^ N.fetch_add(kvgate_kv::hash::PHI, Ordering::Relaxed))
}

/// `prefix` and `bits` as 16 hex digits, written without the formatting machinery (a request
/// id is made per request).
pub fn hex_id(prefix: &str, bits: u64) -> String {
    let mut id = String::with_capacity(prefix.len() + 16);
    id.push_str(prefix);
    (0..16).rev().for_each(|i| id.push(char::from(b"0123456789abcdef"[(bits >> (4 * i)) as usize & 15])));
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_fresh_and_sixteen_hex_digits() {
        let (a, b) = (hex_id("kvg-", fresh_bits()), hex_id("kvg-", fresh_bits()));
        assert_ne!(a, b);
        assert_eq!(hex_id("x", 0xab), "x00000000000000ab");
        assert!(a.len() == 20 && a[4..].bytes().all(|c| c.is_ascii_hexdigit()), "{a}");
    }
}
