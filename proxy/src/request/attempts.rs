//! A request's attempts: the workers it was placed on, in order, the booking it holds on the
//! last one, and what the `time` cost predicted there. Placing an attempt, forgetting one and
//! carrying them over to a rebuilt model are this type's methods, so the three stay in step.

use crate::fleet::Worker;
use kvgate_filters::ledger::{Booking, Footprint, Ledger};
use kvgate_filters::route::time::Prediction;
use std::sync::Arc;

/// A request's attempts (see the module doc).
#[derive(Default)]
pub struct Attempts {
    /// Indices into the model's workers; the last one serves the request now.
    tried: Vec<usize>,
    /// What the request holds on its worker (moved from worker to worker on a retry).
    booking: Option<Booking>,
    /// What the `time` cost predicted on the worker of the last attempt (its first token then
    /// calibrates that worker).
    predicted: Option<Prediction>,
}

impl Attempts {
    /// The workers tried, in order.
    pub fn tried(&self) -> &[usize] {
        &self.tried
    }

    /// How many attempts were placed.
    pub fn count(&self) -> usize {
        self.tried.len()
    }

    /// The worker of the last attempt: the one serving the request now.
    pub fn current(&self) -> Option<usize> {
        self.tried.last().copied()
    }

    /// What the `time` cost predicted on the current worker.
    pub fn predicted(&self) -> Option<Prediction> {
        self.predicted
    }

    /// The booking, while the request holds one.
    pub fn booking(&self) -> Option<&Booking> {
        self.booking.as_ref()
    }

    /// The booking, to record the request's progress on it.
    pub fn booking_mut(&mut self) -> Option<&mut Booking> {
        self.booking.as_mut()
    }

    /// Books `footprint` on worker `w` of `ledger` at `now` (µs on the ledger's clock): the
    /// booking held moves there, or one is made.
    pub fn book(&mut self, ledger: &Arc<Ledger>, w: u16, footprint: Footprint, now: u64) {
        match self.booking.as_mut() {
            Some(b) => b.move_to(w, footprint),
            None => self.booking = Some(ledger.book_at(w, footprint, now)),
        }
    }

    /// Ends the booking: what a leg that is over (a prefill leg) held is released.
    pub fn release(&mut self) {
        self.booking = None;
    }

    /// Records an attempt on worker `idx` (booked already), with what the `time` cost
    /// predicted there.
    pub fn placed(&mut self, idx: usize, predicted: Option<Prediction>) {
        self.tried.push(idx);
        self.predicted = predicted;
    }

    /// Forgets the current attempt: the worker a move order took the request off, when the
    /// move found no destination, so the request is placed again as a retry would be (that
    /// worker included).
    pub fn forget_current(&mut self) {
        self.tried.pop();
    }

    /// Carries the attempts over from the workers `old` to a rebuilt model's `new`, by
    /// identity (those gone are dropped). The booking is released from the old ledger, to be
    /// made again on the new one at the next placement: the counters belong to the workers,
    /// so nothing is counted twice.
    pub fn rebase(&mut self, old: &[Arc<Worker>], new: &[Arc<Worker>]) {
        self.tried = self.tried.iter().filter_map(|&i| new.iter().position(|w| Arc::ptr_eq(w, &old[i]))).collect();
        self.booking = None;
    }
}
