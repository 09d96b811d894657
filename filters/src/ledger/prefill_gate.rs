//! One long prompt sent to a worker at a time. vLLM schedules a running prefill's remaining
//! chunk first and fills what is left of the step's token budget with the next waiting prompt,
//! and a step takes as long as the tokens in it: a prompt that reaches the worker while the one
//! ahead still has steps to go rides in that one's last step and delays its first token by the
//! whole room it fills. Held at the gateway until that last step has begun, it arrives during it
//! and runs in the next one, where it would have finished its first chunk anyway (the worker's
//! queue holds the same tokens either way), and the one ahead gets its first token up to a
//! chunk sooner.
//!
//! Holding moves that room's time from the first token ahead into its decode: its end to end
//! stays, its time per output token grows by the room over its output. A prompt whose expected
//! output is too short to carry that (the caller decides) gives its room away: the next long
//! prompt goes at once, as without a gate.
//!
//! The gate keeps the prompt sent through it last (the tail) until the worker has begun the step
//! that carries its last chunk, or until its first token. The steps are counted from the worker's
//! streamed tokens (each burst ends a step, when it has requests decoding to show them); a
//! prompt sent mid-step runs its first chunk in the next step, after the chunks of the prompts
//! sent through the gate before it. Prefill that did not pass the gate (short prompts, answers
//! that are not streamed, another replica's) is not counted, and makes the next prompt go early:
//! as without a gate, never later. Passes go in arrival order, to the waiters, when the tail is
//! gone or gives its room away. A pass rides with the booking and drops with its first token, its
//! move elsewhere or its end; one sent to a waiter that has already given up drops in the channel
//! and goes on to the next.

use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::oneshot;

/// A worker's gate for long prefills.
#[derive(Debug)]
pub struct PrefillGate {
    state: Mutex<GateState>,
    /// Engine steps the worker began, as its streamed tokens showed them.
    steps: AtomicU64,
    /// The step count at which the tail's last step has begun (`u64::MAX`: none awaited); kept
    /// beside the state so that a step's beginning, seen on every token burst, reads it without
    /// the lock.
    tail_last_step: AtomicU64,
}

impl Default for PrefillGate {
    fn default() -> Self {
        Self { state: Mutex::default(), steps: AtomicU64::new(0), tail_last_step: AtomicU64::new(u64::MAX) }
    }
}

/// The prompt sent last through the gate, while it has no first token.
#[derive(Debug, Clone, Copy)]
struct Tail {
    /// Its pass's number.
    number: u64,
    /// Whether it keeps its last step to itself.
    shelters: bool,
}

/// A prompt waiting for a pass.
#[derive(Debug)]
struct Waiter {
    tx: oneshot::Sender<GatePass>,
    shelters: bool,
    /// The engine steps its prefill takes.
    steps: u64,
}

#[derive(Debug, Default)]
struct GateState {
    tail: Option<Tail>,
    /// The step count at which the last chunk of the prompt sent last through the gate begins
    /// (the next one's first chunk runs after it).
    queued_until: u64,
    /// Numbers for passes.
    next: u64,
    /// Prompts waiting for a pass, in arrival order.
    waiters: VecDeque<Waiter>,
}

impl GateState {
    /// Whether a prompt may go now: nothing sent through the gate is prefilling, or the last
    /// one sent gives its last step's room away.
    fn open(&self) -> bool {
        self.tail.is_none_or(|t| !t.shelters)
    }
}

/// Leave to send a long prompt to the worker, held until its prefill is over.
#[derive(Debug)]
pub struct GatePass {
    gate: Arc<PrefillGate>,
    number: u64,
    /// Counts for the gate (a pass the channel refused does not).
    armed: bool,
}

/// What entering a gate gives.
#[derive(Debug)]
pub enum Entry {
    /// Go now.
    Pass(GatePass),
    /// Wait for the pass; the prompts ahead hand it over in turn.
    Wait(oneshot::Receiver<GatePass>),
}

impl PrefillGate {
    /// A pass at once when no one waits and the prompt sent last through the gate has its
    /// first token, has begun its last step or gives its last step's room away; else a place in
    /// line. `shelters`: this prompt keeps its own last step (the next long prompt waits for
    /// it); `steps`: the engine steps its prefill takes (its chunks).
    pub fn enter(self: &Arc<Self>, shelters: bool, steps: u64) -> Entry {
        let mut s = self.state.lock();
        s.waiters.retain(|w| !w.tx.is_closed());
        if s.waiters.is_empty() && s.open() {
            return Entry::Pass(self.issue(&mut s, shelters, steps));
        }
        let (tx, rx) = oneshot::channel();
        s.waiters.push_back(Waiter { tx, shelters, steps });
        Entry::Wait(rx)
    }

    /// How many prompts wait for a pass.
    pub fn waiting(&self) -> usize {
        let s = self.state.lock();
        s.waiters.iter().filter(|w| !w.tx.is_closed()).count()
    }

    /// The worker began an engine step. Sent mid-step, a prompt's first chunk runs in the
    /// next one, so its last chunk's step begins at its `steps`-th step after it was sent: from
    /// then on, the next prompt fills no room of it, and going now spares it the step it
    /// would lose waiting for the first token.
    pub fn step_began(self: &Arc<Self>) {
        let n = self.steps.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= self.tail_last_step.load(Ordering::Relaxed) {
            let mut s = self.state.lock();
            if n >= self.tail_last_step.load(Ordering::Relaxed) {
                s.tail = None;
                self.tail_last_step.store(u64::MAX, Ordering::Relaxed);
                self.hand_over(&mut s);
            }
        }
    }

    /// A pass for a prompt taking `steps` steps; it becomes the tail.
    fn issue(self: &Arc<Self>, s: &mut GateState, shelters: bool, steps: u64) -> GatePass {
        s.next += 1;
        s.tail = Some(Tail { number: s.next, shelters });
        s.queued_until = s.queued_until.max(self.steps.load(Ordering::Relaxed)) + steps.max(1);
        self.tail_last_step.store(if shelters { s.queued_until } else { u64::MAX }, Ordering::Relaxed);
        GatePass { gate: self.clone(), number: s.next, armed: true }
    }

    /// The waiters go in turn while the gate is open, up to and including the first that
    /// keeps its last step.
    fn hand_over(self: &Arc<Self>, s: &mut GateState) {
        while s.open() {
            let Some(next) = s.waiters.pop_front() else { break };
            let (previous, queued, last) = (s.tail, s.queued_until, self.tail_last_step.load(Ordering::Relaxed));
            let pass = self.issue(s, next.shelters, next.steps);
            if let Err(mut refused) = next.tx.send(pass) {
                // Dropped here, under the lock, it must not come back through `leave`.
                refused.armed = false;
                (s.tail, s.queued_until) = (previous, queued);
                self.tail_last_step.store(last, Ordering::Relaxed);
            }
        }
    }

    /// Pass `number` came back (its first token, or its prompt went elsewhere or ended).
    fn leave(self: &Arc<Self>, number: u64) {
        let mut s = self.state.lock();
        if s.tail.is_some_and(|t| t.number == number) {
            s.tail = None;
            self.tail_last_step.store(u64::MAX, Ordering::Relaxed);
        }
        self.hand_over(&mut s);
    }
}

impl Drop for GatePass {
    fn drop(&mut self) {
        if self.armed {
            self.gate.leave(self.number);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pass(e: Entry) -> GatePass {
        match e {
            Entry::Pass(p) => p,
            Entry::Wait(_) => panic!("expected a pass at once"),
        }
    }

    fn wait(e: Entry) -> oneshot::Receiver<GatePass> {
        match e {
            Entry::Wait(rx) => rx,
            Entry::Pass(_) => panic!("expected to wait"),
        }
    }

    #[test]
    fn prompts_pass_one_at_a_time_in_arrival_order() {
        let g = Arc::new(PrefillGate::default());
        let a = pass(g.enter(true, 2));
        let mut b = wait(g.enter(true, 2));
        let mut c = wait(g.enter(true, 2));
        assert_eq!(g.waiting(), 2);
        assert!(b.try_recv().is_err() && c.try_recv().is_err(), "nothing handed over while the first prefills");
        drop(a);
        let b = b.try_recv().expect("the first in line gets the pass");
        assert!(c.try_recv().is_err(), "the second still waits");
        drop(b);
        let c = c.try_recv().expect("then the second");
        drop(c);
        let _d = pass(g.enter(true, 2));
    }

    #[test]
    fn a_waiter_that_gave_up_is_skipped_and_loses_no_pass() {
        let g = Arc::new(PrefillGate::default());
        let a = pass(g.enter(true, 2));
        let b = wait(g.enter(true, 2));
        let mut c = wait(g.enter(true, 2));
        drop(b);
        drop(a);
        let c_pass = c.try_recv().expect("the pass skips the waiter that left");
        // A pass sent to a waiter that leaves before reading it comes back through the channel.
        let d = wait(g.enter(true, 2));
        drop(c_pass);
        drop(d);
        let _e = pass(g.enter(true, 2));
    }

    #[test]
    fn a_prompt_that_gives_its_room_away_lets_the_next_go_at_once() {
        let g = Arc::new(PrefillGate::default());
        let a = pass(g.enter(false, 2));
        let b = pass(g.enter(true, 2));
        let mut c = wait(g.enter(false, 2));
        let mut d = wait(g.enter(true, 2));
        let mut e = wait(g.enter(true, 2));
        drop(a);
        assert!(c.try_recv().is_err(), "the tail is still the prompt that keeps its room");
        drop(b);
        let _c = c.try_recv().expect("the tail's first token lets the next go");
        let _d = d.try_recv().expect("and, as that one gives its room away, the next too");
        assert!(e.try_recv().is_err(), "but not past one that keeps its room");
        assert_eq!(g.waiting(), 1);
    }

    #[test]
    fn the_next_goes_once_the_last_step_of_the_one_ahead_has_begun() {
        let g = Arc::new(PrefillGate::default());
        g.step_began();
        // Sent mid-step: its two chunks run in the next two steps.
        let a = pass(g.enter(true, 2));
        let mut b = wait(g.enter(true, 1));
        g.step_began();
        assert!(b.try_recv().is_err(), "its first chunk's step began: room is still ahead");
        g.step_began();
        let b = b.try_recv().expect("its last step began: the next fills none of it");
        let mut c = wait(g.enter(true, 1));
        drop(a);
        assert!(c.try_recv().is_err(), "the tail is the prompt that just went, not the one ahead");
        drop(b);
        let _c = c.try_recv().expect("then its first token lets the next go");
    }

    #[test]
    fn a_prompt_sent_behind_others_counts_their_chunks_first() {
        let g = Arc::new(PrefillGate::default());
        let _a = pass(g.enter(false, 3));
        let _b = pass(g.enter(true, 1));
        let mut c = wait(g.enter(true, 1));
        for _ in 0..3 {
            g.step_began();
        }
        assert!(c.try_recv().is_err(), "the steps so far carried the chunks sent before");
        g.step_began();
        assert!(c.try_recv().is_ok(), "the last step of the prompt ahead began");
    }
}
