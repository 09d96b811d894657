//! [`RequestContext`]: one request's cancellation state and its linked children.
//!
//! State only moves forward: `Running → Stopped → Killed` (kill implies stop). Every transition
//! method reports whether *this* call changed the state, so a metric incremented on `true` is
//! counted once per request however many signals (disconnect probe, write error, timeout) race.
//!
//! The state is one atomic and waiters share one `Notify`: a context is made for every request,
//! and a `watch` channel's eight notify slots cost more to create and drop than the rest of
//! it. One atomic step also settles a stop and a kill that race: only the call that finds the
//! context running reports the change.

use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use tokio::sync::Notify;

/// Where a context is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum CancelState {
    /// Not cancelled.
    Running,
    /// Asked to stop producing results (graceful).
    Stopped,
    /// Asked to terminate without draining (e.g. the connection is gone).
    Killed,
}

impl CancelState {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Running,
            1 => Self::Stopped,
            _ => Self::Killed,
        }
    }
}

/// A request's cancellation context.
#[derive(Debug)]
pub struct RequestContext {
    id: String,
    /// A [`CancelState`]; only ever raised.
    state: AtomicU8,
    /// Wakes [`Self::stopped`] and [`Self::killed`] on every change.
    changed: Notify,
    children: Mutex<Vec<Arc<RequestContext>>>,
}

impl RequestContext {
    /// A running context with `id` (the request id, reused by sub-requests).
    pub fn new(id: impl Into<String>) -> Arc<Self> {
        Arc::new(Self { id: id.into(), state: AtomicU8::new(CancelState::Running as u8), changed: Notify::new(), children: Mutex::new(Vec::new()) })
    }

    /// The request id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Current state.
    pub fn state(&self) -> CancelState {
        CancelState::from_u8(self.state.load(Ordering::Acquire))
    }

    /// True once stopped or killed.
    pub fn is_stopped(&self) -> bool {
        self.state() >= CancelState::Stopped
    }

    /// True once killed.
    pub fn is_killed(&self) -> bool {
        self.state() == CancelState::Killed
    }

    /// Asks the request to stop producing results. Idempotent; propagates to children in link
    /// order. Returns true if this call moved the context out of `Running`.
    pub fn stop_generating(&self) -> bool {
        let changed = self.advance(CancelState::Stopped) == CancelState::Running;
        for c in self.children_snapshot() {
            c.stop_generating();
        }
        changed
    }

    /// Alias of [`Self::stop_generating`].
    pub fn stop(&self) -> bool {
        self.stop_generating()
    }

    /// Stops without draining. Propagates to children in link order. Returns true if this call
    /// moved the context out of `Running` (a kill after a stop returns false: the request was
    /// already cancelled).
    pub fn kill(&self) -> bool {
        let changed = self.advance(CancelState::Killed) == CancelState::Running;
        for c in self.children_snapshot() {
            c.kill();
        }
        changed
    }

    /// Links a child: later stop/kill calls reach it. A child linked after the parent was
    /// cancelled is cancelled at once, so no late sub-request escapes.
    pub fn link_child(&self, child: &Arc<RequestContext>) {
        let state = {
            let mut kids = self.children.lock();
            kids.push(child.clone());
            self.state()
        };
        match state {
            CancelState::Running => {}
            CancelState::Stopped => {
                child.stop_generating();
            }
            CancelState::Killed => {
                child.kill();
            }
        }
    }

    /// Completes when the context is stopped or killed (at once if it already is).
    pub async fn stopped(&self) {
        self.reached(CancelState::Stopped).await
    }

    /// Completes when the context is killed (at once if it already is).
    pub async fn killed(&self) {
        self.reached(CancelState::Killed).await
    }

    async fn reached(&self, at_least: CancelState) {
        loop {
            // Registered before the state is read, so a change between the read and the await
            // still wakes it.
            let changed = self.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            if self.state() >= at_least {
                return;
            }
            changed.await;
        }
    }

    /// Raises the state to at least `to`, waking the waiters if it rose; returns the state
    /// before.
    fn advance(&self, to: CancelState) -> CancelState {
        let before = CancelState::from_u8(self.state.fetch_max(to as u8, Ordering::AcqRel));
        if before < to {
            self.changed.notify_waiters();
        }
        before
    }

    fn children_snapshot(&self) -> Vec<Arc<RequestContext>> {
        self.children.lock().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn transitions_are_idempotent_and_report_the_first_change_only() {
        let c = RequestContext::new("r1");
        assert_eq!(c.id(), "r1");
        assert!(!c.is_stopped());
        assert!(c.stop_generating());
        assert!(!c.stop(), "second stop changes nothing");
        assert!(c.is_stopped() && !c.is_killed());
        assert!(!c.kill(), "already cancelled: a kill is not a new cancellation");
        assert!(c.is_killed());
        let k = RequestContext::new("r2");
        assert!(k.kill());
        assert!(k.is_stopped(), "kill implies stop");
        assert!(!k.stop_generating());
    }

    #[test]
    fn children_follow_the_parent_in_link_order() {
        let parent = RequestContext::new("p");
        let a = RequestContext::new("a");
        let b = RequestContext::new("b");
        parent.link_child(&a);
        parent.link_child(&b);
        let grandchild = RequestContext::new("g");
        a.link_child(&grandchild);
        parent.kill();
        assert!(a.is_killed() && b.is_killed() && grandchild.is_killed());
        // Linking to an already-cancelled parent cancels the child immediately.
        let late = RequestContext::new("late");
        parent.link_child(&late);
        assert!(late.is_killed());
    }

    #[test]
    fn a_stop_and_a_kill_that_race_report_one_change() {
        for _ in 0..500 {
            let c = RequestContext::new("r");
            let (a, b) = (c.clone(), c.clone());
            let stop = std::thread::spawn(move || a.stop());
            let kill = std::thread::spawn(move || b.kill());
            let changed = [stop.join().unwrap(), kill.join().unwrap()];
            assert_eq!(changed.iter().filter(|&&x| x).count(), 1, "{changed:?}");
            assert!(c.is_killed());
        }
    }

    #[test]
    fn stopping_a_child_does_not_stop_the_parent() {
        let parent = RequestContext::new("p");
        let child = RequestContext::new("c");
        parent.link_child(&child);
        child.stop();
        assert!(!parent.is_stopped());
    }

    #[tokio::test]
    async fn waiters_wake_on_transition_and_return_at_once_afterwards() {
        let c = RequestContext::new("w");
        let c2 = c.clone();
        let waiter = tokio::spawn(async move { c2.stopped().await });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!waiter.is_finished());
        c.stop();
        tokio::time::timeout(Duration::from_secs(1), waiter).await.unwrap().unwrap();
        tokio::time::timeout(Duration::from_millis(10), c.stopped()).await.expect("already stopped");
        let k = c.clone();
        let killer = tokio::spawn(async move { k.killed().await });
        c.kill();
        tokio::time::timeout(Duration::from_secs(1), killer).await.unwrap().unwrap();
    }
}
