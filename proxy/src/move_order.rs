//! Orders to move a request to another worker, from outside the request's task (the admin
//! `POST /migrate`, later the rescheduler), and their answers. Each in-flight request has one
//! [`Mailbox`] in its registry entry; the request's task watches it while it waits for a
//! worker's first byte (a move is then a plain resend) and while it relays a stream (a move is
//! then a continuation, `request::migrate`).

use crate::fleet::Worker;
use parking_lot::Mutex;
use std::sync::Arc;
use tokio::sync::{Notify, oneshot};

/// Why a request is moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoveReason {
    /// Its worker failed mid-stream (died, reset, stalled, or reported an error).
    Failover,
    /// An operator asked (`POST /migrate`).
    Admin,
    /// A rescheduling policy (its name).
    Rescheduler(&'static str),
    /// The planner removes its worker.
    ScaleDown,
}

impl MoveReason {
    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Failover => "failover",
            Self::Admin => "admin",
            Self::Rescheduler(policy) => policy,
            Self::ScaleDown => "scale_down",
        }
    }
}

/// What a move did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoveReport {
    /// The worker it left.
    pub from: String,
    /// The worker it continues on.
    pub to: String,
    /// `continuation` (running: prompt + generated ids) or `resend` (no token yet).
    pub how: &'static str,
    /// Tokens generated before the move (what the continuation's prompt adds).
    pub generated: usize,
}

/// Why a move was not done.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MoveRefused {
    /// The request cannot move (the reason label).
    #[error("the request is pinned to its worker: {0}")]
    Pinned(&'static str),
    /// The request is not on a worker (queued, finished) or another move is pending.
    #[error("the request cannot move now: {0}")]
    NotNow(&'static str),
    /// The move was tried and failed.
    #[error("the move failed: {0}")]
    Failed(String),
}

/// One order: where to (a worker of the fleet in force; `None`: the router decides).
#[derive(Debug)]
pub struct MoveOrder {
    /// Destination worker, if the caller chose one.
    pub to: Option<Arc<Worker>>,
    /// Who asked.
    pub reason: MoveReason,
    /// Answered once the request moved (or could not).
    pub reply: oneshot::Sender<Result<MoveReport, MoveRefused>>,
}

impl MoveOrder {
    /// Sends the answer (the caller may have gone; nothing to do then).
    pub fn answer(self, r: Result<MoveReport, MoveRefused>) {
        let _ = self.reply.send(r);
    }
}

/// A request's pending order (at most one), closed when the request ends.
#[derive(Debug, Default)]
pub struct Mailbox {
    slot: Mutex<Slot>,
    posted: Notify,
}

#[derive(Debug, Default)]
struct Slot {
    order: Option<(u64, MoveOrder)>,
    next_ticket: u64,
    closed: bool,
}

impl Mailbox {
    /// Posts an order and returns its ticket (for [`Mailbox::withdraw`]); refused while
    /// another is pending or once the request ended.
    pub fn post(&self, order: MoveOrder) -> Result<u64, MoveOrder> {
        let mut slot = self.slot.lock();
        if slot.order.is_some() || slot.closed {
            return Err(order);
        }
        slot.next_ticket += 1;
        let ticket = slot.next_ticket;
        slot.order = Some((ticket, order));
        drop(slot);
        self.posted.notify_one();
        Ok(ticket)
    }

    /// Waits for an order.
    pub async fn next(&self) -> MoveOrder {
        loop {
            if let Some((_, o)) = self.slot.lock().order.take() {
                return o;
            }
            self.posted.notified().await;
        }
    }

    /// Refuses the pending order, if any (the request cannot move any more).
    pub fn refuse_pending(&self, why: MoveRefused) {
        let taken = self.slot.lock().order.take();
        if let Some((_, o)) = taken {
            o.answer(Err(why));
        }
    }

    /// Takes back the order with `ticket` if the request has not read it yet (its caller gave
    /// up); another caller's order is left alone.
    pub fn withdraw(&self, ticket: u64, why: MoveRefused) {
        let mut slot = self.slot.lock();
        if slot.order.as_ref().is_some_and(|(t, _)| *t == ticket) {
            let (_, o) = slot.order.take().expect("checked");
            drop(slot);
            o.answer(Err(why));
        }
    }

    /// The request ended: a pending order is refused, and later ones are not accepted.
    pub fn close(&self) {
        let taken = {
            let mut slot = self.slot.lock();
            slot.closed = true;
            slot.order.take()
        };
        if let Some((_, o)) = taken {
            o.answer(Err(MoveRefused::NotNow("the request ended")));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_order_at_a_time_and_answers_reach_the_caller() {
        let m = Mailbox::default();
        let (tx, rx) = oneshot::channel();
        let w = Arc::new(Worker::new(crate::config::UpstreamUrl::parse("http://127.0.0.1:1").unwrap()));
        m.post(MoveOrder { to: Some(w.clone()), reason: MoveReason::Admin, reply: tx }).unwrap();
        let (tx2, _rx2) = oneshot::channel();
        assert!(m.post(MoveOrder { to: None, reason: MoveReason::Admin, reply: tx2 }).is_err(), "a second order waits its turn");
        let o = m.next().await;
        assert!(o.to.as_ref().is_some_and(|t| Arc::ptr_eq(t, &w)));
        o.answer(Err(MoveRefused::Pinned("unary")));
        assert_eq!(rx.await.unwrap(), Err(MoveRefused::Pinned("unary")));
        let (tx3, rx3) = oneshot::channel();
        let ticket = m.post(MoveOrder { to: None, reason: MoveReason::Admin, reply: tx3 }).unwrap();
        m.withdraw(ticket + 1, MoveRefused::NotNow("not mine"));
        m.withdraw(ticket, MoveRefused::NotNow("timed out"));
        assert_eq!(rx3.await.unwrap(), Err(MoveRefused::NotNow("timed out")), "only its own ticket withdraws an order");
        let (tx4, rx4) = oneshot::channel();
        m.post(MoveOrder { to: None, reason: MoveReason::Admin, reply: tx4 }).unwrap();
        m.close();
        assert_eq!(rx4.await.unwrap(), Err(MoveRefused::NotNow("the request ended")));
        let (tx5, _rx5) = oneshot::channel();
        assert!(m.post(MoveOrder { to: None, reason: MoveReason::Admin, reply: tx5 }).is_err(), "an ended request takes no order");
    }
}
