//! The agent workload through a kv gateway in front of vllm-sim workers, sent as chat
//! completions and as Anthropic Messages: every turn is answered and measured (TTFT, usage) in
//! both, the workers reuse the sessions' prefixes, and kvgate routes the Messages requests on
//! their rendered prompt (no render fallback, cached blocks found on the chosen worker).

#![allow(clippy::float_cmp, reason = "tests compare exact metric values, counts the target reports as floats")]

use kvgate_bench::load::report::Slo;
use kvgate_bench::load::workload::{self, AgentSessions, Api};
use kvgate_bench::load::{RunOptions, run};
use kvgate_tests::cluster::{Cluster, GatewayOpts, TempDir};
use kvgate_tests::target::test_sim_config;
use std::time::Duration;
use vllm_sim::SimConfig;

#[tokio::test]
async fn agent_sessions_as_chat_and_as_messages_through_kvgate() {
    let dir = TempDir::new();
    workload::write_agent_tokenizer(&dir.0).unwrap();
    let w = workload::agent_sessions(AgentSessions {
        sessions: 4,
        turns: 5,
        system_tokens: 400,
        tools: 6,
        user_tokens: 30,
        tool_result_tokens: 60,
        user_every: 4,
        output_tokens: 12,
        rate: 20.0,
        think: Duration::from_millis(50),
        seed: 42,
    });
    assert_eq!(w.len(), 20);
    for api in [Api::Chat, Api::Messages] {
        let sim = SimConfig { tokenizer: Some(dir.0.clone()), ..test_sim_config() };
        let opts = GatewayOpts { mode: "kv".into(), model_extra: format!("tokenizer: {}", dir.0.display()), ..Default::default() };
        let c = Cluster::sims_with_events(2, sim, opts).await;
        let o = RunOptions {
            label: api.name().into(),
            url: c.url("").trim_end_matches('/').to_string(),
            model: "sim-model".into(),
            worker_urls: c.sims.iter().map(|s| s.url()).collect(),
            slo: Slo { ttft_ms: 5000.0, itl_ms: 200.0 },
            progress: false,
            api,
            spread: None,
        };
        let r = run(&o, &w).await;
        assert_eq!(r.ok, 20, "{api:?}: every turn answered: {:?}", r.error_examples);
        assert!(r.ttft_ms.p50 > 0.0 && r.ttft_ms.p50 <= r.ttft_ms.p99, "{api:?}: {:?}", r.ttft_ms);
        assert!(r.rows.iter().all(|row| row.output_tokens == 12 && row.prompt_tokens > 400), "{api:?}: usage read from the stream");
        // Later turns of a session resend its history: their prompts grow.
        assert!(r.rows.iter().any(|row| row.prompt_tokens > 1000), "{api:?}");
        let hit = r.hit_rate.expect("the workers' counters were read");
        assert!(hit > 0.3, "{api:?}: the shared prefix and the histories are reused: {hit}");
        let m = c.gateway_metrics().await;
        let endpoint = if api == Api::Chat { "chat_completions" } else { "messages" };
        assert_eq!(m.sum("kvgate_requests_total", &[("endpoint", endpoint)]), 20.0, "{api:?}");
        assert_eq!(m.sum("kvgate_render_fallback_total", &[]), 0.0, "{api:?}: every prompt rendered");
        let decisions = m.sum("kvgate_routing_overlap_blocks_count", &[]);
        assert!(decisions >= 20.0 && m.sum("kvgate_routing_overlap_blocks_sum", &[]) > 0.0, "{api:?}: routed on cached blocks");
    }
}
