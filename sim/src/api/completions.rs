//! `POST /v1/completions`: text or token-id prompts (one or a batch), unary or SSE, in vLLM's
//! response shapes (`text_completion` objects; `prompt_token_ids` on a choice's first chunk and
//! per-chunk `token_ids` with `return_token_ids`).

use super::error::{ApiError, json_response};
use super::generate::{PreparedPrompt, kv_transfer_reply};
use super::protocol::{CompletionRequest, GenParams, Prompt, check_length, check_token_ids, parse_body};
use super::response::{ChoiceState, ChunkFormat, Meta, collect, delivery_ids_json, delivery_text, echo_header, finish_json, json_str, sse, write_usage};
use super::{AppState, encode};
use crate::engine::Delivery;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{Value, json};
use std::fmt::Write as _;
use std::sync::Arc;

/// Handler.
pub async fn handle(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    match run(&st, &headers, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(st: &AppState, headers: &HeaderMap, body: &[u8]) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(body)?;
    let lora = st.resolve_model(req.common.model.as_deref())?;
    let params = GenParams { lora, ..req.common.validate(st.cfg.max_model_len)? };
    let model = st.reported_model(params.lora.as_deref());
    let add_special = req.add_special_tokens.unwrap_or(true);
    let raw: Vec<Vec<u32>> = match req.prompt {
        None => return Err(ApiError::bad_request("Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)", Some("prompt"))),
        Some(Prompt::Text(t)) => vec![encode(&st.tokenizer, t, add_special).await?],
        Some(Prompt::Texts(ts)) => {
            if ts.is_empty() {
                return Err(ApiError::bad_request("prompt must not be an empty list", Some("prompt")));
            }
            let mut v = Vec::with_capacity(ts.len());
            for t in ts {
                v.push(encode(&st.tokenizer, t, add_special).await?);
            }
            v
        }
        Some(Prompt::Tokens(ids)) => vec![check_token_ids(&ids, st.tokenizer.vocab_size())?],
        Some(Prompt::TokenBatch(b)) => {
            if b.is_empty() {
                return Err(ApiError::bad_request("prompt must not be an empty list", Some("prompt")));
            }
            b.iter().map(|ids| check_token_ids(ids, st.tokenizer.vocab_size())).collect::<Result<_, _>>()?
        }
    };
    let mut prompts = Vec::with_capacity(raw.len());
    for tokens in raw {
        let max_tokens = check_length(tokens.len(), params.max_tokens.or(Some(16)), st.cfg.max_model_len)?;
        prompts.push(PreparedPrompt { tokens, max_tokens });
    }
    let meta = Meta::new("cmpl", headers, req.common.request_id.as_deref(), model, st.cfg.enable_request_id_headers);
    let n = params.n;
    let echo_texts: Vec<String> = if req.echo { prompts.iter().map(|p| st.tokenizer.decode(&p.tokens).unwrap_or_default()).collect() } else { Vec::new() };
    let per_choice_prompt: Vec<Vec<u32>> = prompts.iter().flat_map(|p| std::iter::repeat_n(p.tokens.clone(), n)).collect();
    let mut generation = st.generate(headers, prompts, &params).await?;

    if params.stream {
        let prompt_lens = per_choice_prompt.iter().map(Vec::len).collect();
        let fmt = CompletionChunks {
            st_tok: st.tokenizer.clone(),
            prompts: per_choice_prompt,
            echo: echo_texts.into_iter().flat_map(|t| std::iter::repeat_n(t, n)).collect(),
            return_token_ids: params.return_token_ids,
            continuous_usage: params.continuous_usage,
        };
        return Ok(sse(meta, generation, prompt_lens, params.include_usage, fmt));
    }

    let hold = generation.hold.take();
    let results = collect(generation).await?;
    let mut choices = Vec::with_capacity(results.len());
    let (mut prompt_total, mut completion_total) = (0, 0);
    for (i, r) in results.iter().enumerate() {
        let mut text: String = r.tokens.iter().map(|&t| st.tokenizer.token_text(t)).collect();
        if let Some(e) = echo_texts.get(i / n) {
            text.insert_str(0, e);
        }
        prompt_total += per_choice_prompt[i].len();
        completion_total += r.tokens.len();
        choices.push(json!({
            "index": i, "text": text, "logprobs": null,
            "finish_reason": r.finish.map(|f| f.as_str()), "stop_reason": null,
            "token_ids": if params.return_token_ids { json!(r.tokens) } else { Value::Null },
            "prompt_logprobs": null,
            "prompt_token_ids": if params.return_token_ids { json!(per_choice_prompt[i]) } else { Value::Null },
        }));
    }
    let body = json!({
        "id": meta.id, "object": "text_completion", "created": meta.created, "model": model,
        "choices": choices, "service_tier": null, "system_fingerprint": "vllm-sim",
        "usage": {"prompt_tokens": prompt_total, "total_tokens": prompt_total + completion_total,
                  "completion_tokens": completion_total, "prompt_tokens_details": null},
        "kv_transfer_params": kv_transfer_reply(st, hold).await,
    });
    let mut r = json_response(StatusCode::OK, &body);
    echo_header(&mut r, &meta);
    Ok(r)
}

struct CompletionChunks {
    st_tok: crate::tokenizer::ModelTokenizer,
    prompts: Vec<Vec<u32>>,
    echo: Vec<String>,
    return_token_ids: bool,
    continuous_usage: bool,
}

impl ChunkFormat for CompletionChunks {
    fn token_chunk(&mut self, meta: &Meta, d: &Delivery, s: &ChoiceState, out: &mut String) {
        let mut text = String::new();
        if s.generated == 1
            && let Some(e) = self.echo.get(d.choice)
        {
            text.push_str(e);
        }
        text.push_str(delivery_text(&self.st_tok, d));
        let _ = write!(
            out,
            "data: {{\"id\":{},\"object\":\"text_completion\",\"created\":{},\"model\":{},\"choices\":[{{\"index\":{},\"text\":{},\"logprobs\":null,\"finish_reason\":{},\"stop_reason\":null",
            meta.id_json,
            meta.created,
            meta.model_json,
            d.choice,
            json_str(&text),
            finish_json(d.out.finish)
        );
        if self.return_token_ids {
            if s.generated == 1 {
                let ids = serde_json::to_string(&self.prompts[d.choice]).unwrap_or_default();
                let _ = write!(out, ",\"prompt_token_ids\":{ids}");
            } else {
                out.push_str(",\"prompt_token_ids\":null");
            }
            let _ = write!(out, ",\"token_ids\":{}", delivery_ids_json(d));
        }
        out.push_str("}]");
        if self.continuous_usage {
            out.push(',');
            write_usage(out, s.prompt, s.generated);
        }
        out.push_str("}\n\n");
    }

    fn usage_chunk(&mut self, meta: &Meta, prompt: usize, completion: usize, out: &mut String) {
        let _ = write!(
            out,
            "data: {{\"id\":{},\"object\":\"text_completion\",\"created\":{},\"model\":{},\"choices\":[],",
            meta.id_json, meta.created, meta.model_json
        );
        write_usage(out, prompt, completion);
        out.push_str(",\"system_fingerprint\":\"vllm-sim\"}\n\n");
    }
}
