//! TLS on the listeners: requests over TLS with a self-signed certificate, the pair read
//! again on `POST /reload` and when its files change, a bad pair refused with the old one kept,
//! and the OpenAI SDK over TLS (under tests/real-vllm/run-suite.sh, which names its Python).

use super::*;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls;

/// A self-signed certificate for `localhost` and 127.0.0.1: (certificate PEM, key PEM).
fn self_signed() -> (String, String) {
    let c = rcgen::generate_simple_self_signed(vec!["localhost".to_string(), "127.0.0.1".to_string()]).expect("a certificate");
    (c.cert.pem(), c.signing_key.serialize_pem())
}

/// Writes a pair as a Secret mount swaps it: new files renamed over the old.
fn install(dir: &Path, (cert, key): &(String, String)) {
    for (name, text) in [("tls.crt", cert), ("tls.key", key)] {
        let tmp = dir.join(format!(".{name}.new"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, dir.join(name)).unwrap();
    }
}

/// A TLS client that trusts only `cert`.
fn client(cert: &str) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    for der in rustls::pki_types::pem::PemObject::pem_slice_iter(cert.as_bytes()) {
        roots.add(der.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// One completion over TLS to `addr`, trusting `cert`: the status line, or the handshake's error.
async fn completion(addr: std::net::SocketAddr, cert: &str) -> Result<String, String> {
    let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = client(cert).connect(name, tcp).await.map_err(|e| e.to_string())?;
    let body = r#"{"model":"sim-model","prompt":"hello over tls","max_tokens":3}"#;
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(req.as_bytes()).await.map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    let _ = tls.read_to_end(&mut out).await;
    let text = String::from_utf8_lossy(&out).to_string();
    Ok(text.lines().next().unwrap_or_default().to_string())
}

fn tls_yaml(dir: &Path) -> String {
    format!("tls:\n  cert_file: {}\n  key_file: {}\n", dir.join("tls.crt").display(), dir.join("tls.key").display())
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvgate-tls-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test]
async fn tls_serves_and_takes_new_certificates_without_a_restart() {
    let dir = temp_dir("reload");
    let (first, second) = (self_signed(), self_signed());
    install(&dir, &first);
    let sim = vllm_sim::SimServer::start(test_sim_config()).await.expect("sim starts");
    let c = Cluster::front(&[sim.url()], GatewayOpts { extra: tls_yaml(&dir), ..GatewayOpts::default() }).await;
    let addr = c.gw().listen;
    assert_eq!(completion(addr, &first.0).await.as_deref(), Ok("HTTP/1.1 200 OK"));
    assert!(completion(addr, &second.0).await.is_err(), "a client that trusts another certificate fails its handshake");
    // Plain HTTP on a TLS listener gets no HTTP answer.
    let mut plain = tokio::net::TcpStream::connect(addr).await.unwrap();
    plain.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut out)).await;
    assert!(!out.starts_with(b"HTTP/1.1"), "{}", String::from_utf8_lossy(&out));

    // A reload reads the files again.
    install(&dir, &second);
    assert!(c.http.post(c.admin("/reload")).send().await.unwrap().status().is_success());
    assert_eq!(completion(addr, &second.0).await.as_deref(), Ok("HTTP/1.1 200 OK"));
    assert!(completion(addr, &first.0).await.is_err(), "new handshakes get the new certificate");

    // A broken pair is refused and the one in use stays.
    std::fs::write(dir.join("tls.crt"), "not a certificate").unwrap();
    let _ = c.http.post(c.admin("/reload")).send().await.unwrap();
    assert_eq!(completion(addr, &second.0).await.as_deref(), Ok("HTTP/1.1 200 OK"));
    let m = c.gateway_metrics().await;
    assert!(m.sum("kvgate_tls_reloads_total", &[("listener", "public"), ("result", "rejected")]) >= 1.0);

    // A change of the files alone is seen within seconds, with no reload asked for.
    install(&dir, &first);
    let seen = wait_until(Duration::from_secs(15), || async { completion(addr, &first.0).await.as_deref() == Ok("HTTP/1.1 200 OK") }).await;
    assert!(seen.is_some(), "the changed files were not picked up");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_tls_pair_that_does_not_load_is_refused_with_its_line() {
    let dir = temp_dir("bad");
    let (cert, _) = self_signed();
    let (_, other_key) = self_signed();
    install(&dir, &(cert, other_key));
    let yaml = format!("{}models:\n  - name: m\n    workers:\n      - url: http://127.0.0.1:1\n", tls_yaml(&dir));
    let e = kvgate::config::load::load_str(&yaml, "test", Vec::new()).expect_err("a key of another certificate");
    assert_eq!(e.line, Some(1), "{e}");
    assert!(e.to_string().contains("is not the key of"), "{e}");
    std::fs::remove_file(dir.join("tls.crt")).unwrap();
    let e = kvgate::config::load::load_str(&yaml, "test", Vec::new()).expect_err("a missing file");
    assert!(e.to_string().contains("tls.crt"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The OpenAI SDK (httpx) against the TLS listener, trusting the self-signed certificate as its
/// CA: a completion and a streamed chat completion.
#[tokio::test]
async fn the_openai_sdk_works_over_tls() {
    let Ok(python) = std::env::var("KVGATE_VLLM_PYTHON") else {
        eprintln!("KVGATE_VLLM_PYTHON not set: runs under tests/real-vllm/run-suite.sh");
        return;
    };
    let dir = temp_dir("sdk");
    let pair = self_signed();
    install(&dir, &pair);
    let sim = vllm_sim::SimServer::start(test_sim_config()).await.expect("sim starts");
    let c = Cluster::front(&[sim.url()], GatewayOpts { extra: tls_yaml(&dir), ..GatewayOpts::default() }).await;
    let script = r#"
import sys, httpx, openai
url, ca = sys.argv[1], sys.argv[2]
c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, http_client=httpx.Client(verify=ca))
r = c.completions.create(model="sim-model", prompt="hello over tls", max_tokens=4)
assert r.choices[0].text, r
parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True) if ch.choices]
assert "".join(parts), parts
print("tls ok")
"#;
    let url = format!("https://localhost:{}", c.gw().listen.port());
    let ca = dir.join("tls.crt");
    let out = tokio::process::Command::new(python).args(["-c", script, &url, ca.to_str().unwrap()]).output().await.expect("python runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("tls ok"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
