//! What the background tasks last reported, as the admin API shows it (`GET /planner`,
//! `GET /rescheduling`): typed, written by the tasks and read by the admin listener through
//! the gateway, which holds the latest of each.

use serde::Serialize;

/// One model's planner, as `GET /planner` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct PlannerStatus {
    /// The model.
    pub model: String,
    /// `act` or `observe_only`.
    pub mode: &'static str,
    /// The connector's kind (`local`, `kubernetes`), when one is configured.
    pub connector: Option<&'static str>,
    /// The decode workers it wants, once it decided.
    pub desired: Option<u32>,
    /// Whether a scale-up or scale-down is under way.
    pub changing: bool,
    /// Its last decision.
    pub last_decision: Option<LastDecision>,
    /// The workers its connector started.
    pub started_workers: Vec<StartedWorker>,
}

/// A planner's last decision.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LastDecision {
    /// `up`, `down` or `hold`.
    pub change: &'static str,
    /// Why.
    pub reason: &'static str,
    /// The KV utilisation it read.
    pub kv_usage: f64,
}

/// A worker a planner's connector started.
#[derive(Debug, Clone, Serialize)]
pub struct StartedWorker {
    /// Its name at the connector.
    pub name: String,
    /// Its URL.
    pub url: String,
    /// The GPUs it was given.
    pub gpus: Vec<u32>,
}

/// What one cycle did for one model, as `GET /rescheduling` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct CycleReport {
    /// The model.
    pub model: String,
    /// The pairs the policies (and the plugin) chose, validated.
    pub pairs: Vec<PlannedPair>,
    /// Each request ordered to move, and how its move went.
    pub moves: Vec<MoveDone>,
}

/// A (source, destination) pair a policy chose.
#[derive(Debug, Clone, Serialize)]
pub struct PlannedPair {
    /// The policy (or `plugin`).
    pub policy: String,
    /// Source worker id.
    pub from: u32,
    /// Destination worker id.
    pub to: u32,
}

/// A request a cycle ordered to move.
#[derive(Debug, Clone, Serialize)]
pub struct MoveDone {
    /// The policy that chose its pair.
    pub policy: &'static str,
    /// Source worker id.
    pub from: u32,
    /// Destination worker id.
    pub to: u32,
    /// The request.
    pub request_id: String,
    /// `ok`, or why it did not move.
    pub outcome: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn statuses_serialize_as_the_admin_api_shows_them() {
        let planner = PlannerStatus {
            model: "m".into(),
            mode: "act",
            connector: Some("local"),
            desired: Some(2),
            changing: false,
            last_decision: Some(LastDecision { change: "up", reason: "over_threshold", kv_usage: 0.5 }),
            started_workers: vec![StartedWorker { name: "m-1".into(), url: "http://127.0.0.1:9".into(), gpus: vec![0] }],
        };
        assert_eq!(
            serde_json::to_value(&planner).unwrap(),
            json!({"model": "m", "mode": "act", "connector": "local", "desired": 2, "changing": false,
                   "last_decision": {"change": "up", "reason": "over_threshold", "kv_usage": 0.5},
                   "started_workers": [{"name": "m-1", "url": "http://127.0.0.1:9", "gpus": [0]}]})
        );
        let cycle = CycleReport {
            model: "m".into(),
            pairs: vec![PlannedPair { policy: "decode_load".into(), from: 0, to: 1 }],
            moves: vec![MoveDone { policy: "decode_load", from: 0, to: 1, request_id: "r".into(), outcome: "ok".into() }],
        };
        assert_eq!(
            serde_json::to_value(&cycle).unwrap(),
            json!({"model": "m", "pairs": [{"policy": "decode_load", "from": 0, "to": 1}],
                   "moves": [{"policy": "decode_load", "from": 0, "to": 1, "request_id": "r", "outcome": "ok"}]})
        );
    }
}
