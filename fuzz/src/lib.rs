//! References for the differential fuzz targets: hyper's HTTP/1.1 server and client reading
//! the same bytes kvgate's own code reads, and the comparison both targets make.

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use kvgate::fuzzing::ClientRequest;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One current-thread runtime per fuzzing process.
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    thread_local! {
        static RT: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("a runtime");
    }
    RT.with(|rt| rt.block_on(f))
}

/// What hyper's HTTP/1.1 server reads from `bytes` sent whole and then closed: the requests
/// whose head and body it read completely, and whether it stopped on an error.
pub async fn hyper_requests(bytes: &[u8]) -> (Vec<ClientRequest>, Option<String>) {
    let (mut client, server) = tokio::io::duplex(bytes.len() + 64 * 1024);
    let _ = client.write_all(bytes).await;
    let _ = client.shutdown().await;
    let got: Arc<Mutex<Vec<ClientRequest>>> = Arc::default();
    let seen = got.clone();
    let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let seen = seen.clone();
        async move {
            let (parts, body) = req.into_parts();
            let body = body.collect().await?.to_bytes();
            let target = parts.uri.to_string();
            seen.lock().unwrap().push(ClientRequest { method: parts.method.to_string(), target, body: body.to_vec() });
            Ok::<_, hyper::Error>(hyper::Response::new(Empty::<Bytes>::new()))
        }
    });
    // The client half-closes after its bytes: hyper must still answer what it read. hyper
    // counts trailer fields against its header limit, kvgate bounds trailers by bytes (16 KiB):
    // hyper's limit is set past what 16 KiB can hold (4,096 lines of `a:` and CRLF), so only
    // kvgate's own limits refuse (it refuses heads of over 128 fields, which hyper now reads).
    let conn = hyper::server::conn::http1::Builder::new().half_close(true).max_headers(4096).serve_connection(TokioIo::new(server), svc);
    let drain = async {
        let mut sink = Vec::new();
        let _ = client.read_to_end(&mut sink).await;
    };
    let (served, ()) = tokio::join!(conn, drain);
    let got = std::mem::take(&mut *got.lock().unwrap());
    (got, served.err().map(|e| e.to_string()))
}

/// What hyper's HTTP/1.1 client reads from `bytes` as the answer to a `GET` (or `HEAD`): the
/// status and body, or its error.
pub async fn hyper_response(bytes: &[u8], head_request: bool) -> Result<(u16, Vec<u8>), String> {
    let (gateway, mut worker) = tokio::io::duplex(bytes.len() + 64 * 1024);
    let answer = bytes.to_vec();
    // The worker answers once the request is in, as a server does.
    let serve = async move {
        let mut seen = Vec::new();
        let mut buf = [0u8; 1024];
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
            match worker.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
        let _ = worker.write_all(&answer).await;
        let _ = worker.shutdown().await;
        // Kept open for reading until the client is done, so its writes do not fail.
        let _ = worker.read_to_end(&mut seen).await;
    };
    let client = async {
        // As on the server side, hyper's header-count limit (100) goes past what kvgate's own
        // head limit holds, so only kvgate's limits refuse a head for its size.
        let (mut send, conn) = hyper::client::conn::http1::Builder::new()
            .max_headers(4096)
            .handshake::<_, Empty<Bytes>>(TokioIo::new(gateway))
            .await
            .map_err(|e| e.to_string())?;
        let driver = tokio::spawn(conn);
        let method = if head_request { hyper::Method::HEAD } else { hyper::Method::GET };
        let req = hyper::Request::builder().method(method).uri("/").header("host", "worker").body(Empty::new()).map_err(|e| e.to_string())?;
        let result = async {
            let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
            let status = resp.status().as_u16();
            let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
            Ok((status, body.to_vec()))
        }
        .await;
        drop(send);
        driver.abort();
        result
    };
    let (result, ()) = tokio::join!(client, serve);
    result
}
