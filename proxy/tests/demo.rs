//! `kvgate demo`, the README's first command: it starts simulated workers and the gateway in
//! one process, prints where to connect, and a streamed chat request through it succeeds.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Kills the demo when the test ends, pass or fail.
struct Demo(Child);

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_demo_starts_and_serves_a_streamed_chat_request() {
    let child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["demo", "--workers", "2", "--port", "0", "--admin-port", "0", "--time-scale", "4"])
        .env("KVGATE_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("kvgate runs");
    let mut demo = Demo(child);
    let mut lines = BufReader::new(demo.0.stdout.take().expect("piped stdout")).lines();
    let start = Instant::now();
    let url = loop {
        assert!(start.elapsed() < Duration::from_secs(30), "the demo did not print its address");
        let line = lines.next().expect("the demo is still running").expect("utf-8 output");
        if let Some(rest) = line.trim().strip_prefix("API:") {
            break rest.split_whitespace().next().expect("a URL").trim_end_matches("/v1").to_string();
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let body = rt.block_on(async {
        let r = reqwest::Client::new()
            .post(format!("{url}/v1/chat/completions"))
            .json(&serde_json::json!({"model": "kvgate-demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 20, "stream": true}))
            .send()
            .await
            .expect("the gateway answers");
        assert_eq!(r.status(), 200);
        r.text().await.expect("a body")
    });
    assert!(body.contains("chat.completion.chunk") && body.trim_end().ends_with("data: [DONE]"), "{body}");
    // The status line appears once traffic changes.
    let status = loop {
        assert!(start.elapsed() < Duration::from_secs(30), "no status line");
        let line = lines.next().expect("still running").expect("utf-8");
        if line.starts_with("requests ") {
            break line;
        }
    };
    assert!(status.contains("requests 1") && status.contains("hit rate"), "{status}");
}
