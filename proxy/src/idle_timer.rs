//! A limit on idle time that is re-armed over and over (a client connection between requests,
//! a worker between chunks): one timer, moved later each time. Moving a registered tokio timer
//! later is a store; a fresh `tokio::time::timeout` each time was a timer-wheel insert and
//! removal.

use std::pin::Pin;
use std::time::Duration;
use tokio::time::{Instant, Sleep};

/// One timer, created at first use and moved for each wait.
#[derive(Debug, Default)]
pub struct IdleTimer {
    sleep: Option<Pin<Box<Sleep>>>,
}

impl IdleTimer {
    /// The timer, set to fire `after` from now, to await (or race) as this wait's limit.
    pub fn arm(&mut self, after: Duration) -> Pin<&mut Sleep> {
        let deadline = Instant::now() + after;
        let sleep = self.sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        sleep.as_mut().reset(deadline);
        sleep.as_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn each_arming_sets_a_new_limit_from_now() {
        let mut t = IdleTimer::default();
        let start = Instant::now();
        t.arm(Duration::from_secs(5)).await;
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        // Re-armed after firing, and moved later before firing: the last arming counts.
        let _ = tokio::time::timeout(Duration::from_secs(1), t.arm(Duration::from_secs(3))).await;
        let again = Instant::now();
        t.arm(Duration::from_secs(10)).await;
        assert_eq!(again.elapsed(), Duration::from_secs(10));
    }
}
