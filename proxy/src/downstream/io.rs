//! Small pieces of HTTP plumbing on the client's connection: reading a body with a cap and a
//! deadline, and writing a complete local response.

use super::conn::{BodyReadError, ClientConn};
use super::errors::ClientError;
use crate::h1::response_head::ResponseHead;
use bytes::{Bytes, BytesMut};
use std::time::Duration;

/// Why a request body could not be read.
#[derive(Debug)]
pub enum BodyError {
    /// Over the limit: answer 413.
    TooLarge(u64),
    /// Not received in time: answer 408.
    Timeout,
    /// Its chunked framing is malformed: answer 400 (and close: the rest cannot be framed).
    Malformed(String),
    /// The client went away or sent garbage: nothing to answer.
    Gone,
}

impl BodyError {
    /// The error to send, if any.
    pub fn client_error(&self) -> Option<ClientError> {
        match self {
            BodyError::TooLarge(l) => Some(ClientError::too_large(*l)),
            BodyError::Timeout => Some(ClientError::body_timeout()),
            BodyError::Malformed(why) => Some(ClientError::bad_request(format!("malformed request body: {why}"), None)),
            BodyError::Gone => None,
        }
    }
}

/// Reads the whole request body, refusing more than `limit` bytes or a body slower than
/// `deadline`.
pub async fn read_body(session: &mut ClientConn, limit: u64, deadline: Duration) -> Result<Bytes, BodyError> {
    if let Some(len) = session.req().header_str("content-length").and_then(|v| v.trim().parse::<u64>().ok())
        && len > limit
    {
        return Err(BodyError::TooLarge(limit));
    }
    // Clients that ask first (`Expect: 100-continue`, e.g. curl for large bodies) get the go-ahead.
    if session.expects_continue() && session.write_continue().await.is_err() {
        return Err(BodyError::Gone);
    }
    let read = async {
        // A body that arrived in one piece (the usual case) is handed on without a copy.
        let (mut first, mut rest): (Option<Bytes>, Option<BytesMut>) = (None, None);
        let mut len = 0u64;
        loop {
            match session.read_body().await {
                Ok(Some(chunk)) => {
                    len += chunk.len() as u64;
                    if len > limit {
                        return Err(BodyError::TooLarge(limit));
                    }
                    match (first.take(), rest.as_mut()) {
                        (None, None) if session.body_read() => first = Some(chunk),
                        // More is to come: the piece is copied now, so it does not keep the
                        // read buffer it was split from while a slow client sends the rest.
                        (None, None) => rest = Some(BytesMut::from(&chunk[..])),
                        (Some(f), _) => {
                            let mut buf = BytesMut::from(f);
                            buf.extend_from_slice(&chunk);
                            rest = Some(buf);
                        }
                        (None, Some(buf)) => buf.extend_from_slice(&chunk),
                    }
                }
                Ok(None) => return Ok(rest.map_or_else(|| first.unwrap_or_default(), BytesMut::freeze)),
                Err(BodyReadError::Chunked(e)) => return Err(BodyError::Malformed(e.to_string())),
                Err(_) => return Err(BodyError::Gone),
            }
        }
    };
    tokio::time::timeout(deadline, read).await.unwrap_or(Err(BodyError::Timeout))
}

/// Writes a complete response with a body. Errors mean the client is gone; they are ignored.
/// An `extra` header that would split the head is left out.
pub async fn respond(session: &mut ClientConn, status: u16, content_type: &str, body: Bytes, extra: &[(&str, String)]) {
    let mut h = ResponseHead::new(status);
    let _ = h.header(b"Content-Type", content_type.as_bytes());
    for (k, v) in extra {
        let _ = h.header(k.as_bytes(), v.as_bytes());
    }
    h.length(body.len() as u64);
    if session.write_head(&h).await.is_ok() {
        let _ = session.write_body(body, true).await;
    }
}

/// Sends an OpenAI-shaped error (or Anthropic's, as the error says) with its headers.
pub async fn respond_error(session: &mut ClientConn, e: &ClientError, extra: &[(&str, String)]) {
    let mut all = extra.to_vec();
    all.extend(e.headers());
    respond(session, e.status, "application/json", Bytes::from(e.body()), &all).await;
}

/// Sends JSON.
pub async fn respond_json(session: &mut ClientConn, status: u16, v: &serde_json::Value) {
    respond(session, status, "application/json", Bytes::from(v.to_string()), &[]).await;
}
