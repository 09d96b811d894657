//! `POST /v1/chat/completions`: messages rendered with the model's chat template as vLLM renders
//! them and tokenized without special tokens (vLLM's chat default), unary or SSE in vLLM's
//! shapes: the first chunk of each choice carries `delta: {"role":"assistant","content":""}`,
//! then one content chunk per token, the last one with `finish_reason`.

use super::error::{ApiError, json_response};
use super::generate::{PreparedPrompt, kv_transfer_reply};
use super::protocol::{ChatRequest, GenParams, check_length, parse_body};
use super::response::{ChoiceState, ChunkFormat, Meta, collect, delivery_ids_json, delivery_text, echo_header, finish_json, json_str, sse, write_usage};
use super::{AppState, encode};
use crate::dialect;
use crate::engine::Delivery;
use crate::tokenizer::ModelTokenizer;
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

/// Renders the conversation to prompt text, as vLLM does for chat and chat-form /tokenize
/// (vLLM's message handling and transformers' template rules: [`dialect::render_chat`]).
pub fn render_prompt(
    tok: &ModelTokenizer,
    messages: &[Value],
    add_generation_prompt: Option<bool>,
    continue_final_message: bool,
    tools: Option<&Value>,
    kwargs: Option<&serde_json::Map<String, Value>>,
) -> Result<String, ApiError> {
    let mut chat = json!({"messages": messages, "continue_final_message": continue_final_message});
    if let Some(add) = add_generation_prompt {
        chat["add_generation_prompt"] = add.into();
    }
    if let Some(t) = tools {
        chat["tools"] = t.clone();
    }
    if let Some(kw) = kwargs {
        chat["chat_template_kwargs"] = Value::Object(kw.clone());
    }
    dialect::render_chat(tok, &chat).map_err(|e| ApiError::bad_request(e.message(), if e.reason() == "template" { None } else { Some("messages") }))
}

async fn run(st: &AppState, headers: &HeaderMap, body: &[u8]) -> Result<Response, ApiError> {
    let req: ChatRequest = parse_body(body)?;
    let lora = st.resolve_model(req.common.model.as_deref())?;
    let params = GenParams { lora, ..req.common.validate(st.cfg.max_model_len)? };
    let model = st.reported_model(params.lora.as_deref());
    let text = render_prompt(
        &st.tokenizer,
        &req.messages,
        req.add_generation_prompt,
        req.continue_final_message,
        req.tools.as_ref(),
        req.chat_template_kwargs.as_ref(),
    )?;
    let tokens = encode(&st.tokenizer, text, req.add_special_tokens).await?;
    let max_tokens = check_length(tokens.len(), params.max_tokens, st.cfg.max_model_len)?;
    let prompt_len = tokens.len();
    let prompt_ids = if params.return_token_ids { Some(tokens.clone()) } else { None };
    let meta = Meta::new("chatcmpl", headers, req.common.request_id.as_deref(), model, st.cfg.enable_request_id_headers);
    let mut generation = st.generate(headers, vec![PreparedPrompt { tokens, max_tokens }], &params).await?;

    if params.stream {
        let fmt = ChatChunks { tok: st.tokenizer.clone(), prompt_ids, return_token_ids: params.return_token_ids, continuous_usage: params.continuous_usage };
        let lens = vec![prompt_len; params.n];
        return Ok(sse(meta, generation, lens, params.include_usage, fmt));
    }

    let hold = generation.hold.take();
    let results = collect(generation).await?;
    let completion: usize = results.iter().map(|r| r.tokens.len()).sum();
    let prompt_total = prompt_len * results.len();
    let choices: Vec<Value> = results
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let content: String = r.tokens.iter().map(|&t| st.tokenizer.token_text(t)).collect();
            json!({
                "index": i,
                "message": {"role": "assistant", "content": content, "refusal": null, "annotations": null,
                            "audio": null, "function_call": null, "tool_calls": [], "reasoning": null},
                "logprobs": null, "finish_reason": r.finish.map(|f| f.as_str()), "stop_reason": null,
                "token_ids": if params.return_token_ids { json!(r.tokens) } else { Value::Null },
            })
        })
        .collect();
    let body = json!({
        "id": meta.id, "object": "chat.completion", "created": meta.created, "model": model,
        "choices": choices, "service_tier": null, "system_fingerprint": "vllm-sim",
        "usage": {"prompt_tokens": prompt_total, "total_tokens": prompt_total + completion,
                  "completion_tokens": completion, "prompt_tokens_details": null},
        "prompt_logprobs": null,
        "prompt_token_ids": prompt_ids,
        "kv_transfer_params": kv_transfer_reply(st, hold).await,
    });
    let mut r = json_response(StatusCode::OK, &body);
    echo_header(&mut r, &meta);
    Ok(r)
}

struct ChatChunks {
    tok: ModelTokenizer,
    prompt_ids: Option<Vec<u32>>,
    return_token_ids: bool,
    continuous_usage: bool,
}

impl ChatChunks {
    fn head(meta: &Meta, out: &mut String) {
        let _ = write!(
            out,
            "data: {{\"id\":{},\"object\":\"chat.completion.chunk\",\"created\":{},\"model\":{},\"choices\":[",
            meta.id_json, meta.created, meta.model_json
        );
    }

    fn usage(&self, s: &ChoiceState, out: &mut String) {
        if self.continuous_usage {
            out.push(',');
            write_usage(out, s.prompt, s.generated);
        }
    }
}

impl ChunkFormat for ChatChunks {
    fn token_chunk(&mut self, meta: &Meta, d: &Delivery, s: &ChoiceState, out: &mut String) {
        if s.generated == 1 {
            // The role chunk goes out with the first token, as vLLM sends it on the first output.
            Self::head(meta, out);
            let _ = write!(out, "{{\"index\":{},\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}]", d.choice);
            if let Some(ids) = &self.prompt_ids {
                let _ = write!(out, ",\"prompt_token_ids\":{}", serde_json::to_string(ids).unwrap_or_default());
            }
            let first = ChoiceState { generated: 0, ..*s };
            self.usage(&first, out);
            out.push_str("}\n\n");
        }
        Self::head(meta, out);
        let _ = write!(
            out,
            "{{\"index\":{},\"delta\":{{\"content\":{}}},\"logprobs\":null,\"finish_reason\":{}",
            d.choice,
            json_str(delivery_text(&self.tok, d)),
            finish_json(d.out.finish)
        );
        if d.out.finish.is_some() {
            out.push_str(",\"stop_reason\":null");
        }
        if self.return_token_ids {
            let _ = write!(out, ",\"token_ids\":{}", delivery_ids_json(d));
        }
        out.push_str("}]");
        self.usage(s, out);
        out.push_str("}\n\n");
    }

    fn usage_chunk(&mut self, meta: &Meta, prompt: usize, completion: usize, out: &mut String) {
        Self::head(meta, out);
        out.push_str("],");
        write_usage(out, prompt, completion);
        out.push_str(",\"system_fingerprint\":\"vllm-sim\"}\n\n");
    }
}
