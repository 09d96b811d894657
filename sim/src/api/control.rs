//! vLLM's development endpoints, served only in dev mode (`VLLM_SERVER_DEV_MODE=1`, as vLLM;
//! without it they are 404s): `/pause`, `/resume`, `/is_paused` (its RL router), `/sleep`,
//! `/wake_up`, `/is_sleeping`, `/reset_prefix_cache`, `/reset_mm_cache`, `/reset_encoder_cache`.
//!
//! Behaviour and bodies are vLLM 0.32's, checked against a real server:
//! - `/pause?mode=abort|wait|keep&clear_cache=true`: `abort` (the default) ends every request,
//!   running or queued, with `finish_reason: "abort"`; `wait` lets the running ones finish and
//!   answers when they did; `keep` freezes them. Requests arriving while paused queue (they are
//!   neither refused nor served) until `/resume`. `clear_cache` (default true) drops the prefix
//!   cache when the pause completes (published as `AllBlocksCleared`), preempting frozen
//!   requests, which recompute after the resume. Answers `{"status": "paused"}`.
//! - `/sleep?level=0..2&mode=…` pauses (dropping the cache from level 1) and, from level 1,
//!   marks weights and KV cache asleep; `/wake_up[?tags=…]` wakes them and resumes once all are
//!   awake; `/is_sleeping` is true while paused or asleep.
//! - Query parameters are validated as FastAPI does: a bad one is a 400 worded like pydantic.

use super::AppState;
use super::error::{ApiError, json_response};
use crate::engine::PauseMode;
use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;

/// Tags a level-1 or level-2 sleep puts to sleep.
const SLEEP_TAGS: [&str; 2] = ["weights", "kv_cache"];

/// A query string's parameters, percent-decoded, in order.
fn query_pairs(raw: Option<&str>) -> Vec<(String, String)> {
    raw.unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// `application/x-www-form-urlencoded` decoding: `+` is a space, `%XX` a byte.
fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => match (hex(b[i + 1]), hex(b[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The last value given for `name` (FastAPI reads a scalar query parameter so).
fn last<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    pairs.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// FastAPI's 400 for one invalid query parameter, as vLLM words pydantic's error.
fn invalid(name: &str, kind: &str, msg: &str, input: &str, ctx: Option<&str>) -> ApiError {
    let msg = if msg.contains('\'') { format!("\"{msg}\"") } else { format!("'{msg}'") };
    let ctx = ctx.map(|c| format!(", 'ctx': {c}")).unwrap_or_default();
    ApiError::validation(
        format!("1 validation error:\n  {{'type': '{kind}', 'loc': 'query.{name}', 'msg': {msg}, 'input': '{input}'{ctx}}}"),
        &format!("query.{name}"),
    )
}

fn bool_param(pairs: &[(String, String)], name: &str, default: bool) -> Result<bool, ApiError> {
    let Some(v) = last(pairs, name) else { return Ok(default) };
    match v.to_ascii_lowercase().as_str() {
        "1" | "on" | "t" | "true" | "y" | "yes" => Ok(true),
        "0" | "off" | "f" | "false" | "n" | "no" => Ok(false),
        _ => Err(invalid(name, "bool_parsing", "Input should be a valid boolean, unable to interpret input", v, None)),
    }
}

fn mode_param(pairs: &[(String, String)]) -> Result<PauseMode, ApiError> {
    match last(pairs, "mode") {
        None | Some("abort") => Ok(PauseMode::Abort),
        Some("wait") => Ok(PauseMode::Wait),
        Some("keep") => Ok(PauseMode::Keep),
        Some(v) => Err(invalid("mode", "literal_error", "Input should be 'abort', 'wait' or 'keep'", v, Some("{'expected': \"'abort', 'wait' or 'keep'\"}"))),
    }
}

fn level_param(pairs: &[(String, String)]) -> Result<u8, ApiError> {
    let Some(v) = last(pairs, "level") else { return Ok(1) };
    match v.trim().parse::<i64>() {
        Ok(l) if l < 0 => Err(invalid("level", "greater_than_equal", "Input should be greater than or equal to 0", v, Some("{'ge': 0}"))),
        Ok(l) if l > 2 => Err(invalid("level", "less_than_equal", "Input should be less than or equal to 2", v, Some("{'le': 2}"))),
        Ok(l) => Ok(u8::try_from(l).expect("checked within 0..=2")),
        Err(_) => Err(invalid("level", "int_parsing", "Input should be a valid integer, unable to parse string as an integer", v, None)),
    }
}

impl AppState {
    /// Pauses every engine; returns when all pauses completed.
    async fn pause_engines(&self, mode: PauseMode, clear_cache: bool) -> Result<(), ApiError> {
        let pauses = self.engines.iter().map(|e| e.pause(mode, clear_cache));
        if futures_util::future::join_all(pauses).await.into_iter().all(|ok| ok) {
            Ok(())
        } else {
            Err(ApiError::internal("Failed to pause generation: the engine is not running"))
        }
    }

    /// Whether any engine is paused.
    fn is_paused(&self) -> bool {
        self.engines.iter().any(|e| e.is_paused())
    }
}

fn answer(r: Result<Value, ApiError>) -> Response {
    match r {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(e) => e.into_response(),
    }
}

/// `POST /pause?mode=abort|wait|keep&clear_cache=true`.
pub async fn pause(State(st): State<Arc<AppState>>, RawQuery(q): RawQuery) -> Response {
    let run = async {
        let pairs = query_pairs(q.as_deref());
        let (mode, clear_cache) = (mode_param(&pairs)?, bool_param(&pairs, "clear_cache", true)?);
        st.pause_engines(mode, clear_cache).await?;
        Ok(json!({"status": "paused"}))
    };
    answer(run.await)
}

/// `POST /resume`.
pub async fn resume(State(st): State<Arc<AppState>>) -> Response {
    for e in &st.engines {
        e.resume().await;
    }
    json_response(StatusCode::OK, &json!({"status": "resumed"}))
}

/// `GET /is_paused`.
pub async fn is_paused(State(st): State<Arc<AppState>>) -> Response {
    json_response(StatusCode::OK, &json!({"is_paused": st.is_paused()}))
}

/// `POST /sleep?level=1&mode=abort`: a pause (dropping the prefix cache from level 1), then,
/// from level 1, weights and KV cache asleep.
pub async fn sleep(State(st): State<Arc<AppState>>, RawQuery(q): RawQuery) -> Response {
    let run = async {
        let pairs = query_pairs(q.as_deref());
        let (level, mode) = (level_param(&pairs)?, mode_param(&pairs)?);
        st.pause_engines(mode, level >= 1).await?;
        if level >= 1 {
            *st.sleep.tags.lock() = SLEEP_TAGS.map(String::from).to_vec();
        }
        Ok(json!({"status": "sleeping", "level": level}))
    };
    answer(run.await)
}

/// `POST /wake_up[?tags=weights&tags=kv_cache]`: wakes the tags named (all without any;
/// `scheduling` only resumes) and resumes scheduling once nothing sleeps.
pub async fn wake_up(State(st): State<Arc<AppState>>, RawQuery(q): RawQuery) -> Response {
    let pairs = query_pairs(q.as_deref());
    let tags: Vec<String> = pairs.into_iter().filter(|(k, _)| k == "tags").map(|(_, v)| v).collect();
    let fully_awake = {
        let mut asleep = st.sleep.tags.lock();
        let wake: Vec<&String> = tags.iter().filter(|t| *t != "scheduling").collect();
        if tags.is_empty() {
            asleep.clear();
        } else {
            asleep.retain(|t| !wake.contains(&t));
        }
        asleep.is_empty()
    };
    if fully_awake {
        for e in &st.engines {
            e.resume().await;
        }
    }
    let tags = if tags.is_empty() { Value::Null } else { json!(tags) };
    json_response(StatusCode::OK, &json!({"status": if fully_awake { "awake" } else { "sleeping" }, "tags": tags}))
}

/// `GET /is_sleeping`: paused, or something asleep.
pub async fn is_sleeping(State(st): State<Arc<AppState>>) -> Response {
    let asleep = st.is_paused() || !st.sleep.tags.lock().is_empty();
    json_response(StatusCode::OK, &json!({"is_sleeping": asleep}))
}

/// `POST /reset_prefix_cache[?reset_running_requests=true]`: every engine drops its cache (and
/// publishes AllBlocksCleared); `success` is false if some engine still had blocks in use,
/// unless running requests were to be preempted first, as vLLM reports. `reset_external`
/// (a KV connector's cache) is accepted; there is none.
pub async fn reset_prefix_cache(State(st): State<Arc<AppState>>, RawQuery(q): RawQuery) -> Response {
    let run = async {
        let pairs = query_pairs(q.as_deref());
        let running = bool_param(&pairs, "reset_running_requests", false)?;
        bool_param(&pairs, "reset_external", false)?;
        let mut ok = true;
        for e in &st.engines {
            ok &= e.reset_prefix_cache(running).await;
        }
        if !ok {
            tracing::warn!("Failed to reset prefix cache because some blocks are not freed yet");
        }
        Ok(json!({"success": ok}))
    };
    answer(run.await)
}

/// `POST /reset_mm_cache` and `/reset_encoder_cache`: a 200 without a body (this text-only
/// model has neither cache).
pub async fn reset_other_cache() -> Response {
    Response::new(Body::empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(q: &str) -> Vec<(String, String)> {
        query_pairs(Some(q))
    }

    #[test]
    fn query_parameters_parse_and_refuse_as_fastapi_does() {
        assert_eq!(pairs("a=1&b=x%20y+z&c&d=%zz"), [("a", "1"), ("b", "x y z"), ("c", ""), ("d", "%zz")].map(|(k, v)| (k.to_owned(), v.to_owned())));
        assert_eq!(mode_param(&pairs("")).unwrap(), PauseMode::Abort);
        assert_eq!(mode_param(&pairs("mode=abort&mode=keep")).unwrap(), PauseMode::Keep, "the last value wins");
        let e = mode_param(&pairs("mode=bogus")).unwrap_err();
        assert_eq!(
            e.message,
            "1 validation error:\n  {'type': 'literal_error', 'loc': 'query.mode', 'msg': \"Input should be 'abort', 'wait' or 'keep'\", 'input': 'bogus', 'ctx': {'expected': \"'abort', 'wait' or 'keep'\"}}"
        );
        assert_eq!((e.status.as_u16(), e.kind, e.param.as_deref()), (400, "Bad Request", Some("query.mode")));
        assert!(bool_param(&pairs("clear_cache=No"), "clear_cache", true).is_ok_and(|b| !b));
        assert_eq!(
            bool_param(&pairs("clear_cache=maybe"), "clear_cache", true).unwrap_err().message,
            "1 validation error:\n  {'type': 'bool_parsing', 'loc': 'query.clear_cache', 'msg': 'Input should be a valid boolean, unable to interpret input', 'input': 'maybe'}"
        );
        assert_eq!(level_param(&pairs("")).unwrap(), 1);
        assert_eq!(level_param(&pairs("level=0")).unwrap(), 0);
        assert_eq!(
            level_param(&pairs("level=3")).unwrap_err().message,
            "1 validation error:\n  {'type': 'less_than_equal', 'loc': 'query.level', 'msg': 'Input should be less than or equal to 2', 'input': '3', 'ctx': {'le': 2}}"
        );
        assert!(level_param(&pairs("level=-1")).unwrap_err().message.contains("greater_than_equal"));
        assert!(level_param(&pairs("level=x")).unwrap_err().message.contains("int_parsing"));
    }
}
