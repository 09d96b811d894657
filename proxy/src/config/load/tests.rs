use super::*;
use crate::config::{Migration, Rescheduling};

const GOOD: &str = "\
listen: 127.0.0.1:8080
admin_listen: 127.0.0.1:9090
models:
  - name: llama
    workers:
      - url: http://10.0.0.1:8000
        kv_events: tcp://10.0.0.1:5557
      - url: http://10.0.0.2:8000
";

fn load(text: &str) -> Result<Config, ConfigError> {
    load_str(text, "kvgate.yaml", Vec::<(String, String)>::new())
}

#[test]
fn defaults_fill_in() {
    let c = load(GOOD).unwrap();
    assert_eq!(c.models[0].block_size, 16);
    assert_eq!(c.timeouts.connect_ms, 2_000);
    assert_eq!(c.retries.max_attempts, 3);
    assert_eq!(c.models[0].workers[1].dp_size, 1);
    assert_eq!(c.max_body_bytes.0, 32 << 20);
}

#[test]
fn unknown_keys_are_errors_with_line_and_column() {
    let bad = GOOD.replace("        kv_events:", "        kv_event:");
    let e = load(&bad).unwrap_err();
    assert_eq!((e.line, e.column), (Some(7), Some(9)), "{e}");
    assert!(e.message.contains("unknown field `kv_event`"), "{e}");
    assert!(e.to_string().starts_with("kvgate.yaml:7:9: "), "{e}");
}

#[test]
fn dynamo_routing_flags_map_or_say_why_not() {
    let with = |routing: &str| GOOD.replace("    workers:\n", &format!("    routing:\n{routing}    workers:\n"));
    let c = load(&with("      router_track_output_blocks: true\n      router_track_active_blocks: false\n")).unwrap();
    assert!(c.models[0].routing.track_output_blocks && !c.models[0].routing.track_active_blocks);
    let c = load(GOOD).unwrap();
    assert!(!c.models[0].routing.track_output_blocks && c.models[0].routing.track_active_blocks, "defaults as Dynamo's");
    let e = load(&with("      router_event_threads: 4\n")).unwrap_err();
    assert_eq!((e.line, e.column), (Some(6), Some(7)), "{e}");
    assert!(e.message.contains("`router_event_threads` is a Dynamo option") && e.message.contains("concurrent"), "{e}");
}

#[test]
fn the_router_queue_is_on_in_kv_mode_by_default_and_off_at_zero() {
    let with = |routing: &str| GOOD.replace("    workers:\n", &format!("    routing:\n{routing}    workers:\n"));
    let threshold = |text: &str| load(text).unwrap().models[0].routing.router_queue_threshold();
    assert_eq!(threshold(&with("      mode: kv\n      kv_events: false\n")), Some(crate::config::DEFAULT_KV_QUEUE_THRESHOLD));
    assert_eq!(threshold(GOOD), None, "round robin places without reading load: no queue");
    assert_eq!(threshold(&with("      mode: kv\n      kv_events: false\n      queue_threshold: 0\n")), None, "0 turns it off");
    assert_eq!(threshold(&with("      queue_threshold: 1.5\n")), Some(1.5), "any mode, when set");
    let c = load(&with("      mode: kv\n      kv_events: false\n")).unwrap();
    assert_eq!(c.models[0].shedding.prefill_budget(), 8192, "vLLM's default budget when the operator gives none");
    for bad in ["      queue_threshold: -1\n", "      queue_threshold: .nan\n"] {
        let e = load(&with(bad)).unwrap_err();
        assert!(e.message.contains("routing.queue_threshold must be 0 (no queue) or more"), "{bad}: {e}");
        assert_eq!(e.line, Some(6), "{e}");
    }
    let e = load(&with("      mode: kv\n      kv_events: false\n      queue_max_len: 0\n")).unwrap_err();
    assert!(e.message.contains("queue_max_len and queue_max_wait_ms must be at least 1"), "{e}");
    assert_eq!(e.line, Some(8), "{e}");
    assert!(load(&with("      mode: kv\n      kv_events: false\n      queue_threshold: 0\n      queue_max_len: 0\n")).is_ok(), "no queue, no bound to check");
}

#[test]
fn the_tie_band_must_be_a_number_of_zero_or_more() {
    let with = |routing: &str| GOOD.replace("    workers:\n", &format!("    routing:\n{routing}    workers:\n"));
    assert!((load(GOOD).unwrap().models[0].routing.tie_steps - 0.2).abs() < f64::EPSILON, "a fifth of a step by default");
    assert!(load(&with("      tie_steps: 0\n")).unwrap().models[0].routing.tie_steps.abs() < f64::EPSILON, "0: only equal costs tie");
    for bad in ["      tie_steps: -1\n", "      tie_steps: .nan\n", "      tie_steps: .inf\n"] {
        let e = load(&with(bad)).unwrap_err();
        assert!(e.message.contains("routing.tie_steps must be a number >= 0"), "{bad}: {e}");
        assert!(e.line.is_some(), "{e}");
    }
}

#[test]
fn a_trade_bound_must_be_a_number_of_zero_or_more() {
    let with = |routing: &str| GOOD.replace("    workers:\n", &format!("    routing:\n{routing}    workers:\n"));
    let c = load(GOOD).unwrap();
    assert_eq!((c.models[0].routing.ttft_trade_ratio, c.models[0].routing.ttft_trade_floor_ms), (0.5, 200.0), "on by default");
    assert!(load(&with("      ttft_trade_ratio: 0\n")).unwrap().models[0].routing.ttft_trade_ratio.abs() < f64::EPSILON, "0 turns it off");
    for bad in ["      ttft_trade_ratio: -0.5\n", "      ttft_trade_floor_ms: .nan\n", "      ttft_trade_floor_ms: .inf\n"] {
        let e = load(&with(bad)).unwrap_err();
        assert!(e.message.contains("ttft_trade_ratio and ttft_trade_floor_ms must be numbers >= 0"), "{bad}: {e}");
        assert!(e.line.is_some(), "{e}");
    }
}

#[test]
fn bad_values_point_at_the_value() {
    let e = load(&GOOD.replace("http://10.0.0.2:8000", "https://10.0.0.2:8000")).unwrap_err();
    assert_eq!(e.line, Some(8), "{e}");
    assert!(e.message.contains("https"), "{e}");
    let e = load(&GOOD.replace("listen: 127.0.0.1:8080", "listen: nowhere")).unwrap_err();
    assert_eq!(e.line, Some(1), "{e}");
    let e = load("models: [").unwrap_err();
    assert!(e.line.is_some(), "syntax errors have a location: {e}");
}

#[test]
fn cross_field_errors_are_located() {
    let dup = format!("{GOOD}  - name: llama\n    workers:\n      - url: http://h:1\n");
    let e = load(&dup).unwrap_err();
    assert!(e.message.contains("duplicate model name"), "{e}");
    assert_eq!(e.line, Some(9), "{e}");
    let e = load(&GOOD.replace("10.0.0.2", "10.0.0.1")).unwrap_err();
    assert!(e.message.contains("duplicate worker"), "{e}");
    assert_eq!(e.line, Some(8), "{e}");
    let e = load("models: []\n").unwrap_err();
    assert!(e.message.contains("at least one model"), "{e}");
    let e = load(&GOOD.replace("admin_listen: 127.0.0.1:9090", "admin_listen: 127.0.0.1:8080")).unwrap_err();
    assert!(e.message.contains("admin_listen"), "{e}");
}

#[test]
fn environment_overrides_keys_by_path() {
    let env = vec![
        ("KVGATE_TIMEOUTS__CONNECT_MS".to_string(), "250".to_string()),
        ("KVGATE_MODELS__0__ROUTING__MODE".to_string(), "random".to_string()),
        ("KVGATE_LISTEN".to_string(), "127.0.0.1:7000".to_string()),
        ("KVGATE_LOG".to_string(), "debug".to_string()),
        ("PATH".to_string(), "/bin".to_string()),
    ];
    let c = load_str(GOOD, "kvgate.yaml", env).unwrap();
    assert_eq!(c.timeouts.connect_ms, 250);
    assert_eq!(c.models[0].routing.mode, kvgate_filters::route::Mode::Random);
    assert_eq!(c.listen.port(), 7000);
}

#[test]
fn bad_overrides_name_the_variable() {
    let env = vec![("KVGATE_TIMEOUTS__CONNECT_MS".to_string(), "soon".to_string())];
    let e = load_str(GOOD, "kvgate.yaml", env).unwrap_err();
    assert!(e.to_string().contains("KVGATE_TIMEOUTS__CONNECT_MS"), "{e}");
    let env = vec![("KVGATE_MODELS__5__NAME".to_string(), "x".to_string())];
    let e = load_str(GOOD, "kvgate.yaml", env).unwrap_err();
    assert!(e.to_string().contains("out of range"), "{e}");
}

#[test]
fn the_shipped_example_config_loads_with_its_documented_defaults() {
    let c = load(include_str!("../../../../conf/kvgate.yaml")).unwrap();
    assert_eq!(c.migration, Migration::default(), "conf/kvgate.yaml shows the defaults");
    assert_eq!(c.rescheduling, Rescheduling::default(), "conf/kvgate.yaml shows the seed's defaults");
    assert_eq!(c.models[0].planner, crate::config::Planner::default(), "conf/kvgate.yaml shows seed 002's defaults");
    assert_eq!(c.models[0].workers[0].node.as_deref(), Some("node-a"));
}

#[test]
fn migration_and_rescheduling_keys_are_checked() {
    let c = load(&format!("migration:\n  migration_limit: 0\n{GOOD}")).unwrap();
    assert_eq!(c.migration.limit, 0, "Dynamo's name is accepted");
    let e = load(&format!("rescheduling:\n  rescheduling_policies: decode_load,bogus\n{GOOD}")).unwrap_err();
    assert!(e.to_string().contains("unknown policy \"bogus\""), "{e}");
    let e = load(&format!("rescheduling:\n  rescheduling_req_select_order: XX\n{GOOD}")).unwrap_err();
    assert!(e.line.is_some(), "{e}");
    let e = load(&format!("rescheduling:\n  failover_domain: rack\n{GOOD}")).unwrap_err();
    assert!(e.to_string().contains("rack"), "{e}");
    let c =
        load(&format!("rescheduling:\n  enable_rescheduling: true\n  failover_domain: node-unit\n  rescheduling_req_select_rule: NUM_REQ\n{GOOD}")).unwrap();
    let names: Vec<&str> = c.rescheduling.policies().unwrap().iter().map(|p| p.name).collect();
    assert_eq!(names, ["decode_load", "prefill_failover"], "one failover policy while every worker is neutral");
}

#[test]
fn passthrough_rules_are_checked_where_they_are_written() {
    let with = |section: &str| format!("{section}\n{GOOD}");
    let c = load(&with("passthrough:\n  allow: [/version, /v1/custom/*]\n  deny: [/load]")).unwrap();
    assert!(c.passthrough.passes("/version") && c.passthrough.passes("/v1/custom/x"));
    assert!(!c.passthrough.passes("/load") && !c.passthrough.passes("/ping"));
    // serde_yaml places an error inside a list of plain values at the list; the message names
    // the entry.
    let e = load(&with("passthrough:\n  allow:\n    - /version\n    - /pause")).unwrap_err();
    assert_eq!(e.line, Some(3), "{e}");
    assert!(e.message.contains("/pause is a vLLM control endpoint"), "{e}");
    let e = load(&with("passthrough:\n  deny: [load]")).unwrap_err();
    assert_eq!(e.line, Some(2), "{e}");
    assert!(e.message.contains("starts with '/'"), "{e}");
    assert_eq!(load(GOOD).unwrap().responses.remembered_ids, 100_000);
}

#[test]
fn the_admin_token_comes_from_the_environment_or_a_file_and_errors_are_located() {
    let base = "models:\n  - name: m\n    workers:\n      - url: http://a:1\n";
    let env = |v: &str| vec![("KVGATE_ADMIN_TOKEN".to_string(), v.to_string())];
    let c = load_str(base, "t", env("abc")).unwrap();
    assert!(c.admin_token.as_ref().unwrap().admits(Some(b"Bearer abc")));
    assert!(load_str(base, "t", Vec::new()).unwrap().admin_token.is_none());
    let e = load_str(base, "t", env("  ")).unwrap_err();
    assert_eq!(e.origin, "environment variable KVGATE_ADMIN_TOKEN");
    let missing = format!("admin_token_file: /nonexistent/kvgate-token\n{base}");
    let e = load_str(&missing, "t", Vec::new()).unwrap_err();
    assert_eq!((e.line, e.column), (Some(1), Some(1)), "{e}");
    assert!(e.message.contains("/nonexistent/kvgate-token"), "{e}");
    // The variable wins over the file.
    assert!(load_str(&missing, "t", env("abc")).is_ok());
}

#[test]
fn worker_roles_and_the_disaggregation_section() {
    let pd = GOOD.replace("        kv_events: tcp://10.0.0.1:5557\n", "        kv_events: tcp://10.0.0.1:5557\n        role: prefill\n");
    let c = load(&pd.replace(
        "    workers:\n",
        "    disaggregation:\n      min_prefill_tokens: 512\n      prefill_shedding: {active_prefill_tokens_threshold: 8000}\n    workers:\n",
    ))
    .unwrap();
    let m = &c.models[0];
    assert_eq!((m.workers[0].role, m.workers[1].role), (crate::config::Role::Prefill, crate::config::Role::Both));
    assert_eq!(m.disaggregation.min_prefill_tokens, 512);
    assert_eq!(m.disaggregation.prefill_shedding.and_then(|t| t.active_prefill_tokens_threshold), Some(8000));
    assert_eq!(load(GOOD).unwrap().models[0].disaggregation.min_prefill_tokens, 0, "two legs for every prompt by default");
    let e = load(&pd.replace("role: prefill", "role: prefil")).unwrap_err();
    assert!(e.message.contains("prefil") && e.line == Some(8), "{e}");
    let all = pd.replace("      - url: http://10.0.0.2:8000\n", "      - url: http://10.0.0.2:8000\n        role: prefill\n");
    let e = load(&all).unwrap_err();
    assert!(e.message.contains("every worker has role prefill"), "{e}");
    let e =
        load(&GOOD.replace("    workers:\n", "    disaggregation:\n      prefill_shedding: {active_decode_blocks_threshold: 2}\n    workers:\n")).unwrap_err();
    assert!(e.message.contains("prefill_shedding"), "{e}");
    assert_eq!(load(GOOD).unwrap().models[0].disaggregation.prefill_timeout_ms, 60_000);
    let e = load(&GOOD.replace("    workers:\n", "    disaggregation:\n      prefill_timeout_ms: 0\n    workers:\n")).unwrap_err();
    assert!(e.message.contains("prefill_timeout_ms"), "{e}");
    let e = load(&pd.replace("    workers:\n", "    planner:\n      enabled: true\n      mode: observe_only\n    workers:\n")).unwrap_err();
    assert!(e.message.contains("does not scale a disaggregated fleet"), "{e}");
}

#[test]
fn latency_objectives_per_model_are_checked_with_their_place() {
    let c = load(&GOOD.replace("    workers:\n", "    slo:\n      ttft_ms: 800\n      tpot_ms: 40\n    workers:\n")).unwrap();
    assert_eq!(c.models[0].slo, kvgate_filters::route::Slo { ttft_ms: Some(800.0), tpot_ms: Some(40.0) });
    assert!(!load(GOOD).unwrap().models[0].slo.is_set(), "no objectives by default");
    let e = load(&GOOD.replace("    workers:\n", "    slo:\n      tpot_ms: -5\n    workers:\n")).unwrap_err();
    assert!(e.message.contains("slo: tpot_ms must be a positive number"), "{e}");
    let e = load(&GOOD.replace("    workers:\n", "    slo:\n      ttft: 800\n    workers:\n")).unwrap_err();
    assert!(e.message.contains("ttft") && e.line.is_some(), "an unknown key names its line: {e}");
}

#[test]
fn tenants_are_checked_with_the_tenant_named_and_keys_never_shown() {
    let with = |t: &str| format!("{t}{GOOD}");
    let c = load(&with(
        "tenants:\n  list:\n    - name: a\n      keys_sha256: [5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8]\n      weight: 2\n",
    ))
    .unwrap();
    let t = c.tenants.unwrap();
    assert_eq!((t.list[0].digests.len(), t.list[0].weight), (1, 2.0));
    let e = load(&with("tenants:\n  list:\n    - name: a\n      weight: -1\n")).unwrap_err();
    assert_eq!(e.line, Some(1), "{e}");
    assert!(e.message.contains("tenant \"a\": weight"), "{e}");
    let e = load(&with("tenants:\n  list:\n    - name: a\n      keys_env: KVGATE_TEST_NO_SUCH_VARIABLE\n")).unwrap_err();
    assert!(e.message.contains("KVGATE_TEST_NO_SUCH_VARIABLE is not set"), "{e}");
    let e = load(&with("tenants:\n  list:\n    - name: a\n      key: sk-plain\n")).unwrap_err();
    assert!(e.message.contains("unknown field `key`") && e.line == Some(4), "a plain key has no place in the config: {e}");
}

#[test]
fn tracing_is_off_unless_an_endpoint_is_named_and_a_bad_one_is_refused_where_it_is() {
    let with = |t: &str| format!("{t}{GOOD}");
    assert_eq!(load(GOOD).unwrap().tracing, None);
    let c = load(&with("tracing:\n  otlp_endpoint: http://collector:4318\n")).unwrap();
    let t = c.tracing.unwrap();
    assert_eq!((t.traces_url().unwrap().as_str(), t.sample_ratio, t.service_name.as_str()), ("http://collector:4318/v1/traces", 1.0, "kvgate"));
    let e = load(&with("tracing:\n  otlp_endpoint: https://collector:4318\n")).unwrap_err();
    assert!(e.message.contains("tracing: otlp_endpoint must be an http:// URL") && e.line == Some(1), "{e}");
    let e = load(&with("tracing:\n  otlp_endpoint: http://c:4318\n  sample_ratio: 2\n")).unwrap_err();
    assert!(e.message.contains("sample_ratio"), "{e}");
    let e = load(&with("tracing:\n  endpoint: http://c:4318\n")).unwrap_err();
    assert!(e.message.contains("unknown field `endpoint`") && e.line == Some(2), "{e}");
}
