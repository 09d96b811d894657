//! The drop-in promise: every path a vLLM server answers is answered through the gateway
//! as the server answers it, except vLLM's control endpoints, which the public listener never
//! forwards; `passthrough` rules adjust the rest.

use super::{error_shape, sim};
use kvgate_tests::cluster::{Cluster, GatewayOpts};
use serde_json::{Value, json};

async fn call(http: &reqwest::Client, method: &str, url: &str, body: Option<&Value>) -> (u16, String) {
    let mut r = http.request(method.parse().unwrap(), url);
    if let Some(b) = body {
        r = r.json(b);
    }
    let r = r.send().await.expect("sent");
    (r.status().as_u16(), r.text().await.expect("body"))
}

#[tokio::test]
async fn unknown_paths_pass_through_and_control_paths_do_not() {
    let opts = GatewayOpts { extra: "passthrough:\n  deny: [/load]\n".into(), ..Default::default() };
    let c = Cluster::sims(1, sim(100.0), opts).await;
    let direct = c.sims[0].url();
    // Passed through unchanged, the query too.
    for (method, path) in [("GET", "/version"), ("GET", "/version?verbose=1"), ("GET", "/no/such/path"), ("POST", "/no/such/path")] {
        let d = call(&c.http, method, &format!("{direct}{path}"), None).await;
        let v = call(&c.http, method, &c.url(path), None).await;
        assert_eq!(d, v, "{method} {path}");
    }
    // A served endpoint the worker does not know answers as the worker does.
    let body = json!({"model": "sim-model", "messages": [[{"role": "user", "content": "x"}]]});
    let d = call(&c.http, "POST", &format!("{direct}/v1/chat/completions/batch"), Some(&body)).await;
    let v = call(&c.http, "POST", &c.url("/v1/chat/completions/batch"), Some(&body)).await;
    assert_eq!(d.0, v.0, "{d:?} / {v:?}");
    // Control endpoints: refused here under any spelling, while the worker itself would obey.
    assert_eq!(call(&c.http, "POST", &format!("{direct}/reset_prefix_cache"), None).await.0, 200);
    for path in ["/reset_prefix_cache", "/pause", "/pa%75se", "/v1/../pause", "/SLEEP", "/v1/load_lora_adapter/"] {
        let (s, text) = call(&c.http, "POST", &c.url(path), Some(&json!({}))).await;
        let v: Value = serde_json::from_str(&text).unwrap();
        error_shape(s, 403, &v);
        assert_eq!(v["error"]["type"], "permission_error", "{path}: {v}");
    }
    // The configuration's deny list, and HEAD (whose answer has no body to relay).
    let (s, text) = call(&c.http, "GET", &c.url("/load"), None).await;
    error_shape(s, 404, &serde_json::from_str(&text).unwrap());
    assert_eq!(call(&c.http, "HEAD", &c.url("/version"), None).await.0, 405);
    // The gateway's own refusals on the Anthropic endpoints are in Anthropic's shape.
    let body = json!({"model": "nope", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]});
    let (s, text) = call(&c.http, "POST", &c.url("/v1/messages"), Some(&body)).await;
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!((s, v["type"].as_str(), v["error"]["type"].as_str()), (404, Some("error"), Some("not_found_error")), "{v}");
    let (s, text) = call(&c.http, "GET", &c.url("/v1/messages"), None).await;
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!((s, v["type"].as_str()), (405, Some("error")), "a wrong method on /v1/messages is refused in Anthropic's shape too: {v}");
    let m = c.gateway_metrics().await;
    assert_eq!(m.sum("kvgate_refused_paths_total", &[("reason", "control")]), 6.0);
    assert_eq!(m.sum("kvgate_refused_paths_total", &[("reason", "not_passed_through")]), 1.0);
    assert!(m.sum("kvgate_requests_total", &[("endpoint", "passthrough")]) >= 4.0);
}

/// The clients agents use, through kvgate in front of two real vLLM servers with the response
/// store on (tests/real-vllm/sdk_drop_in.py): the same outputs and usage as direct, and every
/// `previous_response_id` turn on the worker holding the first. Runs under
/// tests/real-vllm/run-suite.sh, which names both servers and the venv's Python.
#[tokio::test]
async fn the_anthropic_and_openai_sdks_work_through_the_gateway() {
    let (Ok(url), Ok(url2), Ok(python)) = (std::env::var("KVGATE_TARGET_URL"), std::env::var("KVGATE_TARGET_URL_2"), std::env::var("KVGATE_VLLM_PYTHON"))
    else {
        eprintln!("KVGATE_TARGET_URL_2 / KVGATE_VLLM_PYTHON not set: runs under tests/real-vllm/run-suite.sh");
        return;
    };
    let model = std::env::var("KVGATE_TARGET_MODEL").unwrap_or_else(|_| "tiny".into());
    let c = Cluster::front(&[url.clone(), url2], GatewayOpts::real_vllm(&model)).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/real-vllm/sdk_drop_in.py");
    let gateway = c.url("");
    let out = tokio::process::Command::new(python).args([script, gateway.trim_end_matches('/'), &url, &model]).output().await.expect("python runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{text}");
    assert!(out.status.success() && text.contains("all checks passed"), "{text}");
    // The worker of each turn, as the gateway names it: round robin spreads the first turns over
    // both workers, and each second turn, its GET and a cancel follow its first.
    let mut firsts = std::collections::HashSet::new();
    for n in 0..4 {
        let turn = |body: Value| c.http.post(c.url("/v1/responses")).json(&body).send();
        let r1 = turn(json!({"model": model, "input": format!("turn one {n}"), "max_output_tokens": 4, "temperature": 0})).await.unwrap();
        let w1 = r1.headers()["x-kvgate-worker"].to_str().unwrap().to_string();
        let id = r1.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
        let r2 = turn(json!({"model": model, "input": "turn two", "previous_response_id": id, "max_output_tokens": 4, "temperature": 0})).await.unwrap();
        assert_eq!((r2.status().as_u16(), r2.headers()["x-kvgate-worker"].to_str().unwrap()), (200, w1.as_str()), "conversation {n}");
        let got = c.http.get(c.url(&format!("/v1/responses/{id}"))).send().await.unwrap();
        assert_eq!((got.status().as_u16(), got.headers()["x-kvgate-worker"].to_str().unwrap()), (200, w1.as_str()));
        firsts.insert(w1);
    }
    assert_eq!(firsts.len(), 2, "first turns went to both workers");
    let m = c.gateway_metrics().await;
    assert!(m.sum("kvgate_requests_total", &[("endpoint", "messages"), ("status", "200")]) >= 4.0);
    assert!(m.sum("kvgate_requests_total", &[("endpoint", "responses"), ("status", "200")]) >= 12.0);
}
