//! What `/sleep` put to sleep, kept in the server's state (the endpoints: `control.rs`).

use parking_lot::Mutex;

/// What the simulated executor holds asleep (`/sleep` level 1 and 2: weights and KV cache).
#[derive(Debug, Default)]
pub struct Sleep {
    pub(super) tags: Mutex<Vec<String>>,
}
