//! Phase 1b, the tenant's limits: a request whose tenant has no room for it now (requests,
//! input tokens, output tokens per minute; requests in flight) is refused with 429 in its
//! API's shape, with the wait until it would fit; an admitted one holds its place in the
//! tenant's concurrency until it ends. Prompt tokens are counted from the tokenized prompt
//! (as vLLM counts them) or, without a tokenizer (or for a batch of prompts), estimated from
//! the body's size; either way the worker's `usage` settles the count at the end ([`settle`]),
//! and a request that was never served gets back what admission took.

use super::RequestState;
use super::outcome::Outcome;
use crate::error::GatewayError;
use crate::gateway::Gateway;

/// Admits the request past its tenant's limits, or refuses it.
pub fn admit(gw: &Gateway, req: &mut RequestState) -> Result<(), Outcome> {
    let estimate = req.body.len() as u64 / 4;
    let counted = req.prompt.as_ref().filter(|p| p.whole).map_or(0, |p| p.tokens.len() as u64);
    let Some(t) = req.tenant.as_mut() else { return Ok(()) };
    let input = if counted > 0 { counted } else { estimate };
    let m = &gw.metrics.tenants;
    let tenant = t.tenant.clone();
    let name = tenant.name.as_str();
    match tenant.account.admit(input) {
        Ok(admitted) => {
            t.admitted(admitted);
            m.admitted.with_label_values(&[name]).inc();
            m.in_flight.with_label_values(&[name]).inc();
            Ok(())
        }
        Err(exceeded) => {
            m.limited.with_label_values(&[name, exceeded.dimension.label()]).inc();
            tracing::debug!(request_id = req.ctx.id(), tenant = name, limit = exceeded.dimension.label(), "tenant limit reached");
            Err(Outcome::Refused(GatewayError::RateLimited(Box::new((name.to_string(), *exceeded)))))
        }
    }
}

/// The request starts being served (it left the router queue, or never had to wait): its
/// prompt counts towards its tenant's fair share from now.
pub fn serving(req: &mut RequestState) {
    if let Some(t) = req.tenant.as_mut() {
        t.serving();
    }
}

/// The request ended: its charges settle with the worker's counts (or, never served, what
/// admission took is given back) and its place is given back.
pub fn settle(gw: &Gateway, req: &mut RequestState) {
    let Some(t) = req.tenant.as_mut() else { return };
    if !t.is_admitted() {
        return;
    }
    let (input, output) = t.settle();
    let m = &gw.metrics.tenants;
    let name = t.tenant.name.as_str();
    m.in_flight.with_label_values(&[name]).dec();
    m.tokens.with_label_values(&[name, "input"]).inc_by(input);
    m.tokens.with_label_values(&[name, "output"]).inc_by(output);
}
