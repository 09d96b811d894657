//! Which requests a migration pair moves (Llumnix's "Migration Request Types" and "Migration
//! Request Ordering"): a rule says how much (`NUM_REQ` requests, `TOKEN` tokens, `RATIO`
//! percent of the source's KV cache), an order says which first.

use serde::Deserialize;

/// How much a pair moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Rule {
    /// `value` requests.
    #[serde(rename = "NUM_REQ")]
    NumReq,
    /// Requests until `value` tokens (prompt + generated) moved.
    #[serde(rename = "TOKEN")]
    Token,
    /// Requests until `value` percent of the source's KV cache moved.
    #[serde(rename = "RATIO")]
    Ratio,
}

/// Which requests go first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Order {
    /// Last come, among running requests.
    #[serde(rename = "LCR")]
    Lcr,
    /// First come, among running requests.
    #[serde(rename = "FCR")]
    Fcr,
    /// Longest sequence first, among running requests.
    #[serde(rename = "LR")]
    Lr,
    /// Shortest sequence first, among running requests.
    #[serde(rename = "SR")]
    Sr,
    /// First come, among waiting requests.
    #[serde(rename = "FCW")]
    Fcw,
    /// First come waiting; if none wait, shortest running.
    #[serde(rename = "FCWSR")]
    Fcwsr,
}

/// How much a pair takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Take {
    /// By rule and order, up to `value`.
    Amount {
        /// The rule.
        rule: Rule,
        /// The order.
        order: Order,
        /// Requests, tokens or percent.
        value: f64,
    },
    /// Every request (consolidation empties its source).
    All,
}

/// A request on the source, as selection sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// Request id.
    pub id: String,
    /// Prompt + generated tokens.
    pub tokens: u64,
    /// Arrival order (smaller came first).
    pub arrival: u64,
    /// Still waiting for its first token.
    pub waiting: bool,
}

/// The ids to move from `reqs` (the source's movable requests); `kv_tokens` is the source's KV
/// capacity in tokens (for `RATIO`; 0 when unknown, then RATIO moves one request).
pub fn select(reqs: &[Candidate], take: Take, kv_tokens: u64) -> Vec<String> {
    let (rule, order, value) = match take {
        Take::All => return reqs.iter().map(|r| r.id.clone()).collect(),
        Take::Amount { rule, order, value } => (rule, order, value.max(0.0)),
    };
    let ordered = ordered(reqs, order);
    let budget = match rule {
        #[allow(clippy::cast_sign_loss, reason = "the amount is clamped to 0 or more above")]
        Rule::NumReq => return ordered.iter().take(value as usize).map(|r| r.id.clone()).collect(),
        Rule::Token => value,
        Rule::Ratio => value / 100.0 * kv_tokens as f64,
    };
    // At least one request, then until the budget is covered.
    let mut out = Vec::new();
    let mut moved = 0.0;
    for r in ordered {
        if !out.is_empty() && moved >= budget {
            break;
        }
        moved += r.tokens as f64;
        out.push(r.id.clone());
    }
    out
}

fn ordered(reqs: &[Candidate], order: Order) -> Vec<&Candidate> {
    let running = || reqs.iter().filter(|r| !r.waiting).collect::<Vec<_>>();
    let mut v = match order {
        Order::Fcw => reqs.iter().filter(|r| r.waiting).collect(),
        Order::Fcwsr if reqs.iter().any(|r| r.waiting) => reqs.iter().filter(|r| r.waiting).collect(),
        _ => running(),
    };
    match order {
        Order::Lcr => v.sort_by_key(|r| std::cmp::Reverse(r.arrival)),
        Order::Fcr | Order::Fcw => v.sort_by_key(|r| r.arrival),
        Order::Lr => v.sort_by_key(|r| (std::cmp::Reverse(r.tokens), r.arrival)),
        Order::Sr => v.sort_by_key(|r| (r.tokens, r.arrival)),
        Order::Fcwsr if v.iter().all(|r| r.waiting) && !v.is_empty() => v.sort_by_key(|r| r.arrival),
        Order::Fcwsr => v.sort_by_key(|r| (r.tokens, r.arrival)),
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reqs() -> Vec<Candidate> {
        vec![
            Candidate { id: "a".into(), tokens: 900, arrival: 1, waiting: false },
            Candidate { id: "b".into(), tokens: 300, arrival: 2, waiting: false },
            Candidate { id: "c".into(), tokens: 500, arrival: 3, waiting: false },
            Candidate { id: "w".into(), tokens: 50, arrival: 4, waiting: true },
        ]
    }

    fn take(rule: Rule, order: Order, value: f64) -> Take {
        Take::Amount { rule, order, value }
    }

    #[test]
    fn token_sr_1024_moves_the_shortest_until_1024_tokens() {
        // Llumnix's defaults: TOKEN / SR / 1024.
        assert_eq!(select(&reqs(), take(Rule::Token, Order::Sr, 1024.0), 0), ["b", "c", "a"]);
        assert_eq!(select(&reqs(), take(Rule::Token, Order::Sr, 700.0), 0), ["b", "c"]);
        assert_eq!(select(&reqs(), take(Rule::Token, Order::Sr, 1.0), 0), ["b"], "at least one");
    }

    #[test]
    fn orders_and_rules_follow_the_seed() {
        assert_eq!(select(&reqs(), take(Rule::NumReq, Order::Lcr, 2.0), 0), ["c", "b"]);
        assert_eq!(select(&reqs(), take(Rule::NumReq, Order::Fcr, 1.0), 0), ["a"]);
        assert_eq!(select(&reqs(), take(Rule::NumReq, Order::Lr, 1.0), 0), ["a"]);
        assert_eq!(select(&reqs(), take(Rule::NumReq, Order::Fcw, 5.0), 0), ["w"]);
        assert_eq!(select(&reqs(), take(Rule::NumReq, Order::Fcwsr, 1.0), 0), ["w"]);
        let running: Vec<_> = reqs().into_iter().filter(|r| !r.waiting).collect();
        assert_eq!(select(&running, take(Rule::NumReq, Order::Fcwsr, 1.0), 0), ["b"], "no waiting: shortest running");
        // RATIO 10% of a 10,000-token cache: 1,000 tokens.
        assert_eq!(select(&reqs(), take(Rule::Ratio, Order::Sr, 10.0), 10_000), ["b", "c", "a"]);
        assert_eq!(select(&reqs(), Take::All, 0).len(), 4);
    }
}
