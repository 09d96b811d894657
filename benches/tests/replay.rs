//! `kvgate-bench` replays the shipped Mooncake trace (time-scaled, cut short) through a kv
//! gateway in front of vllm-sim workers, and its report is consistent: counts add up,
//! percentiles are ordered, the hit rate is a rate, and the files are written.

use kvgate_bench::load::report::{self, Slo};
use kvgate_bench::load::workload::{self, Workload};
use kvgate_bench::load::{RunOptions, run};
use kvgate_bench::trace;
use kvgate_tests::cluster::{Cluster, GatewayOpts, TempDir};
use kvgate_tests::target::test_sim_config;
use std::path::Path;
use vllm_sim::SimConfig;

#[tokio::test]
async fn a_short_trace_replay_through_kvgate_reports_consistent_figures() {
    let t = trace::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/mooncake_synthetic_trace.jsonl")).unwrap();
    // The first 120 requests (about 33 s of trace, a dozen of them reusing an earlier prefix) at
    // 40x, prompts cut to 2,048 tokens.
    let w = workload::from_trace(&t, workload::PromptFormat::Ids, 40.0, (120, 2048, 16), 4000);
    let Workload::Open(jobs) = &w else { panic!("a trace is open loop") };
    assert_eq!(jobs.len(), 120);
    let sim = SimConfig { max_model_len: 4096, time_scale: 8.0, ..test_sim_config() };
    let c = Cluster::sims_with_events(2, sim, GatewayOpts { mode: "kv".into(), ..Default::default() }).await;
    let o = RunOptions {
        label: "kvgate-kv".into(),
        url: c.url("").trim_end_matches('/').to_string(),
        model: "sim-model".into(),
        worker_urls: c.sims.iter().map(|s| s.url()).collect(),
        slo: Slo { ttft_ms: 5000.0, itl_ms: 200.0 },
        progress: false,
        api: workload::Api::Chat,
        spread: None,
    };
    let r = run(&o, &w).await;
    assert_eq!(r.requests, 120);
    assert_eq!(r.ok + r.shed + r.errors, r.requests, "counts add up");
    assert_eq!(r.ok, 120, "every request served: {:?}", r.error_examples);
    for q in [r.ttft_ms, r.itl_ms, r.e2e_ms] {
        assert!(q.p50 > 0.0 && q.p50 <= q.p90 && q.p90 <= q.p99, "ordered: {q:?}");
    }
    assert!(r.ttft_ms.p50 <= r.e2e_ms.p50);
    let hit = r.hit_rate.expect("the workers' counters were read");
    assert!((0.0..=1.0).contains(&hit), "{hit}");
    assert!(hit > 0.0, "the trace shares prefixes: {hit}");
    assert!(r.output_tokens_per_s > 0.0 && r.requests_per_s > 0.0);
    assert!((0.0..=1.0).contains(&r.goodput_fraction));
    let dir = TempDir::new();
    report::write(&dir.0, std::slice::from_ref(&r), "test").unwrap();
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.0.join("results.json")).unwrap()).unwrap();
    assert_eq!(json[0]["requests"], 120);
    assert!(std::fs::read_to_string(dir.0.join("results.md")).unwrap().contains("| kvgate-kv | 120 | 120 |"));
    assert!(std::fs::read_to_string(dir.0.join("ttft_cdf.svg")).unwrap().contains("<polyline"));
}
