//! The drop-in promise (#34): every path a vLLM server answers is answered through the gateway
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
    let m = c.gateway_metrics().await;
    assert_eq!(m.sum("kvgate_refused_paths_total", &[("reason", "control")]), 6.0);
    assert_eq!(m.sum("kvgate_refused_paths_total", &[("reason", "not_passed_through")]), 1.0);
    assert!(m.sum("kvgate_requests_total", &[("endpoint", "passthrough")]) >= 4.0);
}
