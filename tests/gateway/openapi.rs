//! docs/endpoints.md's table against the gateway and against a live vLLM: every row's kind
//! is what the gateway does with its path; on real vLLM (tests/real-vllm/run-suite.sh), every
//! path and method of the server's `openapi.json` has a row, and every row the server serves
//! answers through the gateway with the status it answers directly (control paths: 403).

use kvgate::endpoint::PathKind;
use kvgate_tests::Target;
use kvgate_tests::cluster::{Cluster, GatewayOpts};
use serde_json::Value;

/// One row of the table: path, methods, kind.
struct Row {
    path: String,
    methods: Vec<String>,
    kind: String,
}

fn table() -> Vec<Row> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/endpoints.md")).expect("docs/endpoints.md");
    doc.lines()
        .filter(|l| l.starts_with("| `/"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let path = cells[1].trim_end_matches('†').trim().trim_matches('`').to_string();
            Row { path, methods: cells[2].split(',').map(|m| m.trim().to_string()).collect(), kind: cells[3].to_string() }
        })
        .collect()
}

#[test]
fn every_row_of_the_table_is_what_the_gateway_does() {
    let rows = table();
    assert!(rows.len() > 60, "the table was read: {} rows", rows.len());
    for r in &rows {
        assert_eq!(PathKind::of(&r.path).label(), r.kind, "docs/endpoints.md row {}", r.path);
    }
}

#[tokio::test]
async fn a_live_servers_paths_are_all_in_the_table_and_answer_as_direct() {
    let t = Target::start().await;
    if !t.external {
        // vllm-sim serves no openapi.json; the real-vLLM suite runs this.
        return;
    }
    let spec: Value = t.http.get(format!("{}/openapi.json", t.url)).send().await.unwrap().json().await.unwrap();
    let rows = table();
    let mut missing = Vec::new();
    for (path, ops) in spec["paths"].as_object().expect("paths") {
        for method in ops.as_object().unwrap().keys() {
            let m = method.to_uppercase();
            if !rows.iter().any(|r| &r.path == path && r.methods.contains(&m)) {
                missing.push(format!("{m} {path}"));
            }
        }
    }
    assert!(missing.is_empty(), "vLLM serves paths docs/endpoints.md does not list: {missing:?}");
    let c = Cluster::front(std::slice::from_ref(&t.url), GatewayOpts { model: t.model.clone(), ..Default::default() }).await;
    let (mut compared, mut refused) = (0, 0);
    for r in rows.iter().filter(|r| spec["paths"].get(&r.path).is_some() && !r.path.contains('{') && r.kind != "local") {
        for m in &r.methods {
            let send = |url: String| {
                let req = t.http.request(m.parse().unwrap(), url);
                let req = if m == "POST" { req.header("content-type", "application/json").body("{}") } else { req };
                async move { req.send().await.expect("sent").status().as_u16() }
            };
            let via = send(c.url(&r.path)).await;
            if r.kind == "control" {
                // Never sent to the worker directly: it would obey.
                assert_eq!(via, 403, "{m} {}", r.path);
                refused += 1;
            } else {
                let direct = send(format!("{}{}", t.url, r.path)).await;
                assert_eq!(via, direct, "{m} {} through the gateway", r.path);
                compared += 1;
            }
        }
    }
    eprintln!("{compared} paths answered as direct, {refused} control paths refused");
    assert!(compared >= 20 && refused >= 25, "{compared} compared, {refused} refused");
}
