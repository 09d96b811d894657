//! Tenants end to end: client keys, per-tenant limits answered in each API's shape, counts as
//! the worker counts them, and keys that never leave a trace. Every test records the gateway's
//! logs at debug level (kvgate's crates at trace), so the key test can look for its keys in
//! them. Tests that take their worker from `Target::start()` run on vllm-sim, and on real vLLM
//! under tests/real-vllm/run-suite.sh, which also names the Python that has the SDKs.

use kvgate_tests::Target;
use kvgate_tests::cluster::{Cluster, GatewayOpts, TempDir};
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// Everything the process's gateways logged.
fn logs() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = buf.clone();
        let filter = tracing_subscriber::EnvFilter::new("debug,kvgate=trace,kvgate_filters=trace,reqwest=warn,hyper_util=warn");
        let _ = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(false).with_writer(move || Sink(sink.clone())).try_init();
        buf
    })
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn hex(key: &str) -> String {
    kvgate::config::tenants::to_hex(&kvgate::config::tenants::digest_of(key.as_bytes()))
}

/// The tokenizer routing counts with: the real model's under the real-vLLM suite, else the
/// simulator's.
fn tokenizer(t: &Target) -> String {
    match std::env::var("KVGATE_TARGET_TOKENIZER") {
        Ok(dir) if t.external => dir,
        _ => "builtin".into(),
    }
}

struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: Value,
    text: String,
}

async fn send(http: &reqwest::Client, url: &str, headers: &[(&str, &str)], body: &Value) -> Answer {
    let mut r = http.post(url).json(body);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let resp = r.send().await.expect("sent");
    let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
    let text = resp.text().await.expect("body");
    Answer { status, headers, body: serde_json::from_str(&text).unwrap_or(Value::Null), text }
}

fn header<'a>(a: &'a Answer, name: &str) -> &'a str {
    a.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_else(|| panic!("no {name} in {:?}", a.headers))
}

#[tokio::test]
async fn keys_name_tenants_and_limits_answer_in_each_apis_shape_without_a_trace_of_a_key() {
    let logs = logs();
    let t = Target::start().await;
    let dir = TempDir::new();
    let (key_a, key_b, wrong) = ("sk-team-a-SECRET-1f0c", "sk-team-b-SECRET-77aa", "sk-unknown-SECRET-0000");
    let keys_b = dir.0.join("team-b.keys");
    std::fs::write(&keys_b, format!("# team b\n{key_b}\n")).unwrap();
    let extra = format!(
        "tenants:\n  require_key: true\n  list:\n    - name: team-a\n      keys_sha256: [{}]\n      requests_per_minute: 3\n    - name: team-b\n      keys_file: {}\n      requests_per_minute: 1\n",
        hex(key_a),
        keys_b.display()
    );
    let c = Cluster::front(std::slice::from_ref(&t.url), GatewayOpts { model: t.model.clone(), extra, ..GatewayOpts::real_vllm(&t.model) }).await;
    let completion = json!({"model": t.model, "prompt": "tenants", "max_tokens": 2});
    let message = json!({"model": t.model, "max_tokens": 2, "messages": [{"role": "user", "content": "tenants"}]});
    let (url, messages) = (c.url("/v1/completions"), c.url("/v1/messages"));
    let mut seen: Vec<String> = Vec::new();

    // No key, an unknown one: 401 in each API's shape, the key not repeated.
    let none = send(&c.http, &url, &[], &completion).await;
    assert_eq!((none.status, none.body["error"]["type"].as_str()), (401, Some("invalid_request_error")), "{}", none.text);
    let unknown = send(&c.http, &url, &[("authorization", &format!("Bearer {wrong}"))], &completion).await;
    assert_eq!(unknown.status, 401, "{}", unknown.text);
    let anthropic = send(&c.http, &messages, &[("x-api-key", wrong)], &message).await;
    assert_eq!(
        (anthropic.status, anthropic.body["type"].as_str(), anthropic.body["error"]["type"].as_str()),
        (401, Some("error"), Some("authentication_error")),
        "{}",
        anthropic.text
    );
    seen.extend([none.text, unknown.text, anthropic.text]);

    // Team A's three requests a minute, then OpenAI's 429 and headers.
    let mut ids = Vec::new();
    for _ in 0..3 {
        let ok = send(&c.http, &url, &[("authorization", &format!("Bearer {key_a}"))], &completion).await;
        assert_eq!(ok.status, 200, "{}", ok.text);
        ids.push(header(&ok, "x-request-id").to_string());
    }
    let over = send(&c.http, &url, &[("authorization", &format!("Bearer {key_a}"))], &completion).await;
    assert_eq!(
        (over.status, over.body["error"]["type"].as_str(), over.body["error"]["code"].as_u64()),
        (429, Some("rate_limit_exceeded"), Some(429)),
        "{}",
        over.text
    );
    assert_eq!((header(&over, "x-ratelimit-limit-requests"), header(&over, "x-ratelimit-remaining-requests")), ("3", "0"));
    let retry: u64 = header(&over, "retry-after").parse().unwrap();
    let retry_ms: u64 = header(&over, "retry-after-ms").parse().unwrap();
    // One request back takes a third of the minute.
    assert!((19..=21).contains(&retry) && (18_000..=20_001).contains(&retry_ms), "{retry} s, {retry_ms} ms");
    assert!(header(&over, "x-ratelimit-reset-requests").ends_with('s'));
    assert!(over.body["error"]["message"].as_str().unwrap().contains("team-a"), "{}", over.text);

    // Team B on the Messages API, by x-api-key: Anthropic's 429 and headers.
    let ok = send(&c.http, &messages, &[("x-api-key", key_b)], &message).await;
    assert_eq!(ok.status, 200, "{}", ok.text);
    let over_b = send(&c.http, &messages, &[("x-api-key", key_b)], &message).await;
    assert_eq!((over_b.status, over_b.body["error"]["type"].as_str()), (429, Some("rate_limit_error")), "{}", over_b.text);
    assert_eq!(header(&over_b, "anthropic-ratelimit-requests-limit"), "1");
    assert!(header(&over_b, "anthropic-ratelimit-requests-reset").ends_with('Z'));
    assert!(header(&over_b, "retry-after").parse::<u64>().is_ok());
    seen.extend([over.text, over_b.text]);

    // What the operator sees: tenants, receipts, metrics; none of it holds a key.
    let tenants: Value = c.http.get(c.admin("/tenants")).send().await.unwrap().json().await.unwrap();
    let a = tenants["tenants"].as_array().unwrap().iter().find(|x| x["name"] == "team-a").unwrap().clone();
    assert_eq!((a["used"]["requests"].as_u64(), a["limits"]["requests_per_minute"]["limit"].as_u64()), (Some(3), Some(3)), "{tenants}");
    let receipt: Value = c.http.get(c.admin(&format!("/requests/{}", ids[0]))).send().await.unwrap().json().await.unwrap();
    assert_eq!(receipt["tenant"], "team-a", "{receipt}");
    let metrics = c.http.get(c.admin("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("kvgate_tenant_rate_limited_total{limit=\"requests\",tenant=\"team-a\"} 1"), "{metrics}");
    assert!(metrics.contains("kvgate_tenant_unauthorized_total 3"), "{metrics}");
    let requests = c.http.get(c.admin("/requests")).send().await.unwrap().text().await.unwrap();
    seen.extend([tenants.to_string(), receipt.to_string(), metrics, requests]);
    let logged = String::from_utf8_lossy(&logs.lock()).to_string();
    assert!(logged.contains("tenant limit reached"), "the logs were recorded");
    seen.push(logged);
    for (what, text) in ["errors", "errors", "errors", "errors", "errors", "/tenants", "receipt", "metrics", "/requests", "logs"].iter().zip(&seen) {
        assert!(!text.contains("SECRET"), "a key is in the {what}");
    }
}

/// Prompt tokens are counted at admission as the worker counts them: no correction was needed
/// after any request, and the request refused is the one that would have passed the limit,
/// by the count the worker gives it.
#[tokio::test]
async fn input_tokens_are_counted_as_the_worker_counts_them_and_refused_at_the_limit() {
    logs();
    let t = Target::start().await;
    let extra = "tenants:\n  list:\n    - name: default\n      input_tokens_per_minute: 10000\n".to_string();
    let model_extra = format!("tokenizer: {}\n", tokenizer(&t));
    let c = Cluster::front(
        std::slice::from_ref(&t.url),
        GatewayOpts {
            model: t.model.clone(),
            mode: "kv".into(),
            routing_extra: "kv_events: false".into(),
            extra,
            model_extra,
            ..GatewayOpts::real_vllm(&t.model)
        },
    )
    .await;
    let body = |i: usize, chat: bool| {
        let text = format!("{} {}", kvgate_tests::target::unique_text(400 + i * 37), i);
        if chat {
            ("/v1/chat/completions", json!({"model": t.model, "max_tokens": 1, "messages": [{"role": "user", "content": text}]}))
        } else {
            ("/v1/completions", json!({"model": t.model, "max_tokens": 1, "prompt": text}))
        }
    };
    let started = Instant::now();
    let mut served = 0;
    let mut refused = None;
    for i in 0..60 {
        let (path, b) = body(i, i % 2 == 1);
        let a = send(&c.http, &c.url(path), &[], &b).await;
        match a.status {
            200 => served += a.body["usage"]["prompt_tokens"].as_u64().unwrap(),
            429 => {
                refused = Some((path, b, a));
                break;
            }
            s => panic!("{s}: {}", a.text),
        }
    }
    let (path, b, a) = refused.expect("the limit was reached");
    let tenants: Value = c.http.get(c.admin("/tenants")).send().await.unwrap().json().await.unwrap();
    let d = &tenants["tenants"][0];
    assert_eq!(d["used"]["input_tokens_corrected"].as_u64(), Some(0), "counted as the worker counts: {tenants}");
    assert_eq!(d["used"]["input_tokens"].as_u64(), Some(served), "{tenants}");
    // What the worker counts for the refused request.
    let direct = send(&t.http, &format!("{}{path}", t.url), &[], &b).await;
    let worker_count = direct.body["usage"]["prompt_tokens"].as_u64().unwrap();
    let message = a.body["error"]["message"].as_str().unwrap().to_string();
    let number = |after: &str| -> u64 { message.split(after).nth(1).unwrap().split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap() };
    assert_eq!(number("Requested "), worker_count, "{message}");
    // It did not fit, and everything before it did: the limit plus what refilled meanwhile.
    assert!(number("Remaining ") < worker_count, "{message}");
    let refilled = started.elapsed().as_secs_f64() * 10_000.0 / 60.0;
    assert!(served as f64 <= 10_000.0 + refilled + 1.0 && served + worker_count > 10_000, "served {served}, then {worker_count}, refill {refilled:.0}");
    assert_eq!(header(&a, "x-ratelimit-limit-tokens"), "10000");
}

/// The OpenAI and Anthropic SDKs, with their default retries, meet a 429, wait the
/// `retry-after` they are given and then succeed (tests/tenants/sdk_retries.py). Needs the
/// Python that has both SDKs: runs under tests/real-vllm/run-suite.sh.
#[tokio::test]
async fn the_sdks_wait_the_retry_after_they_are_given_and_then_succeed() {
    logs();
    let Ok(python) = std::env::var("KVGATE_VLLM_PYTHON") else {
        eprintln!("KVGATE_VLLM_PYTHON not set: runs under tests/real-vllm/run-suite.sh");
        return;
    };
    let t = Target::start().await;
    let extra = format!(
        "tenants:\n  require_key: true\n  list:\n    - name: openai-sdk\n      keys_sha256: [{}]\n      requests_per_minute: 6\n    - name: anthropic-sdk\n      keys_sha256: [{}]\n      requests_per_minute: 6\n",
        hex("sk-openai-sdk"),
        hex("sk-anthropic-sdk")
    );
    let c = Cluster::front(std::slice::from_ref(&t.url), GatewayOpts { model: t.model.clone(), extra, ..GatewayOpts::real_vllm(&t.model) }).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tenants/sdk_retries.py");
    let out = tokio::process::Command::new(python).args([script, c.url("").trim_end_matches('/'), &t.model]).output().await.expect("python runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{text}");
    assert!(out.status.success() && text.contains("all checks passed"), "{text}");
    let metrics = c.http.get(c.admin("/metrics")).send().await.unwrap().text().await.unwrap();
    for tenant in ["openai-sdk", "anthropic-sdk"] {
        assert!(metrics.contains(&format!("kvgate_tenant_rate_limited_total{{limit=\"requests\",tenant=\"{tenant}\"}} 1")), "one 429 each: {metrics}");
    }
}

/// Keys and limits change on reload without dropping a request: a stream admitted under the
/// old key ends whole, the old key is refused after, the new one admitted, and the tenant's
/// usage carries over.
#[tokio::test]
async fn a_reload_changes_keys_and_limits_without_dropping_a_request() {
    logs();
    let dir = TempDir::new();
    let keys = dir.0.join("team.keys");
    std::fs::write(&keys, "sk-reload-old\n").unwrap();
    let tenants =
        |rpm: u32| format!("tenants:\n  require_key: true\n  list:\n    - name: team\n      keys_file: {}\n      requests_per_minute: {rpm}\n", keys.display());
    let sim = vllm_sim::SimConfig { time_scale: 1.0, ..kvgate_tests::target::test_sim_config() };
    let c = Cluster::sims(1, sim, GatewayOpts { extra: tenants(100), ..GatewayOpts::default() }).await;
    let body = json!({"model": "sim-model", "prompt": "reload", "max_tokens": 60, "ignore_eos": true, "stream": true});
    let stream = c.http.post(c.url("/v1/completions")).bearer_auth("sk-reload-old").json(&body).send().await.unwrap();
    assert_eq!(stream.status(), 200);
    std::fs::write(&keys, "sk-reload-new\n").unwrap();
    let config = std::fs::read_to_string(&c.config_path).unwrap().replace("requests_per_minute: 100", "requests_per_minute: 50");
    std::fs::write(&c.config_path, config).unwrap();
    let r = c.http.post(c.admin("/reload")).send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    let text = stream.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]") && text.matches("\"text\"").count() >= 60, "the stream ended whole: {text}");
    let unary = json!({"model": "sim-model", "prompt": "reload", "max_tokens": 2});
    let old = c.http.post(c.url("/v1/completions")).bearer_auth("sk-reload-old").json(&unary).send().await.unwrap();
    assert_eq!(old.status(), 401);
    let new = c.http.post(c.url("/v1/completions")).bearer_auth("sk-reload-new").json(&unary).send().await.unwrap();
    assert_eq!(new.status(), 200);
    let t: Value = c.http.get(c.admin("/tenants")).send().await.unwrap().json().await.unwrap();
    let team = &t["tenants"][0];
    assert_eq!((team["used"]["requests"].as_u64(), team["limits"]["requests_per_minute"]["limit"].as_u64()), (Some(2), Some(50)), "{t}");
}
