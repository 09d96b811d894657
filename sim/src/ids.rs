//! Fresh ids in vLLM's forms: request ids and the engine's default id.

/// 16 random hex digits, as vLLM's `random_uuid()` gives for request ids.
pub fn random_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    format!("{:016x}", crate::sampler::mix(t ^ COUNTER.fetch_add(crate::sampler::PHI, Ordering::Relaxed)))
}

/// A random version-4 UUID string, as Python's `str(uuid.uuid4())` (vLLM's default
/// `engine_id`).
pub fn random_uuid() -> String {
    let (a, b) = (random_id(), random_id());
    format!("{}-{}-4{}-{}{}-{}", &a[..8], &a[8..12], &a[13..16], ["8", "9", "a", "b"][usize::from(b.as_bytes()[0] % 4)], &b[1..4], &b[4..16])
}
