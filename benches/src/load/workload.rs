//! Workloads: what to send and when. Open-loop request lists (a Mooncake trace replay,
//! synthetic shared-prefix traffic, or a mix of short chat-like prompts and long documents,
//! with Poisson arrivals) and closed-loop multi-turn sessions (each turn waits for the
//! previous answer and sends the history back): chat, or a coding agent's with tools, tool calls
//! and tool results, sent as chat completions or as Anthropic Messages ([`Api`]).
//!
//! Synthetic prompts are drawn as token ids or as text ([`PromptFormat`]): text is made of
//! words that are one token each in vllm-sim's built-in tokenizer ([`words`]), so a text prompt
//! has the same length in tokens as its id form there, and every router accepts it (SMG refuses
//! token-id prompts).

use crate::Rng;
use crate::trace::{self, TraceRequest};
use serde_json::{Value, json};
use std::sync::OnceLock;
use std::time::Duration;

/// One request of an open-loop workload.
#[derive(Debug, Clone)]
pub struct Job {
    /// When to send it, from the start of the run.
    pub at: Duration,
    /// `/v1/completions` or `/v1/chat/completions`.
    pub path: &'static str,
    /// The body without `model` (added by the runner).
    pub body: Value,
}

/// A multi-turn session: turn k is sent when turn k−1 has been answered, plus `think`. The
/// same session can be sent as chat completions or as Anthropic Messages ([`Api`]); both
/// forms carry the same conversation ([`Session::request`]).
#[derive(Debug, Clone)]
pub struct Session {
    /// When the first turn goes out.
    pub start: Duration,
    /// The system prompt shared by the session's turns, in parts: Messages sends one text block
    /// per part, chat their concatenation (vLLM joins system blocks without a separator).
    pub system: Vec<String>,
    /// Tools offered to the model (empty: none sent).
    pub tools: Vec<Tool>,
    /// What the client sends, in order.
    pub turns: Vec<Turn>,
    /// Output tokens per turn.
    pub output_tokens: u32,
    /// Pause between an answer and the next turn.
    pub think: Duration,
}

/// The API a session is sent as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// OpenAI chat completions (`/v1/chat/completions`).
    Chat,
    /// Anthropic Messages (`/v1/messages`).
    Messages,
}

impl Api {
    /// `chat` or `messages`.
    pub fn name(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Messages => "messages",
        }
    }

    /// The request path.
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Messages => "/v1/messages",
        }
    }
}

/// A tool an agent session offers: a function of string parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tool {
    /// Its name.
    pub name: String,
    /// What it does.
    pub description: String,
    /// Parameters (all required strings) and their descriptions.
    pub params: Vec<(String, String)>,
}

impl Tool {
    /// The JSON schema of its input.
    fn schema(&self) -> Value {
        let props: serde_json::Map<String, Value> = self.params.iter().map(|(p, d)| (p.clone(), json!({"type": "string", "description": d}))).collect();
        json!({"type": "object", "properties": props, "required": self.params.iter().map(|(p, _)| p.as_str()).collect::<Vec<_>>()})
    }
}

/// A tool call the client writes into the assistant's turn (the simulated model writes text
/// only), as an agent's model would have asked for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// Call id (`toolu_…`), echoed by the result.
    pub id: String,
    /// The tool.
    pub name: String,
    /// Its arguments, string-valued.
    pub input: Vec<(String, String)>,
}

impl ToolCall {
    fn input(&self) -> Value {
        Value::Object(self.input.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect())
    }
}

/// What the client sends next in a session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Turn {
    /// A user message.
    User(String),
    /// The previous answer ends with `call`, and this turn returns its result.
    ToolResult {
        /// The call appended to the previous answer.
        call: ToolCall,
        /// What the tool returned.
        output: String,
    },
}

/// One message of a session's history, whatever the API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// The user's text.
    User(String),
    /// The model's answer, and the tool call the client appended to it.
    Assistant {
        /// The generated text.
        text: String,
        /// The call, when the next turn returns a tool result.
        call: Option<ToolCall>,
    },
    /// A tool's result.
    ToolResult {
        /// The call it answers.
        id: String,
        /// Its text.
        output: String,
    },
}

impl Session {
    /// The history after turn `turn` is sent, given the answers so far (`answers[k]` for turn
    /// k < `turn`).
    pub fn history(&self, answers: &[String]) -> Vec<Entry> {
        let mut h = Vec::with_capacity(2 * answers.len() + 1);
        for (k, turn) in self.turns.iter().enumerate().take(answers.len() + 1) {
            if k > 0 {
                let call = match turn {
                    Turn::ToolResult { call, .. } => Some(call.clone()),
                    Turn::User(_) => None,
                };
                h.push(Entry::Assistant { text: answers[k - 1].clone(), call });
            }
            h.push(match turn {
                Turn::User(t) => Entry::User(t.clone()),
                Turn::ToolResult { call, output } => Entry::ToolResult { id: call.id.clone(), output: output.clone() },
            });
        }
        h
    }

    /// The streamed request body (without `model`) of `history` sent as `api`. Chat: the system
    /// parts joined in a system message, tool calls with JSON-string arguments, results as
    /// `tool` messages, `ignore_eos` (as every chat workload here) and usage in the stream.
    /// Messages: `system` as text blocks (the last marked `cache_control`, as agents mark it),
    /// content as blocks, `tool_use` / `tool_result` blocks, `max_tokens`, `stream`. vLLM
    /// converts the second into the first (`kvgate_tokenize::dialect::messages`), so both
    /// render to the same prompt.
    pub fn request(&self, api: Api, history: &[Entry]) -> Value {
        match api {
            Api::Chat => {
                let mut messages = Vec::with_capacity(history.len() + 1);
                if !self.system.is_empty() {
                    messages.push(json!({"role": "system", "content": self.system.concat()}));
                }
                for e in history {
                    messages.push(match e {
                        Entry::User(t) => json!({"role": "user", "content": t}),
                        Entry::Assistant { text, call: None } => json!({"role": "assistant", "content": text}),
                        Entry::Assistant { text, call: Some(c) } => json!({
                            "role": "assistant",
                            "content": if text.is_empty() { Value::Null } else { text.clone().into() },
                            "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.input().to_string()}}],
                        }),
                        Entry::ToolResult { id, output } => json!({"role": "tool", "tool_call_id": id, "content": output}),
                    });
                }
                let mut body = json!({"messages": messages, "max_tokens": self.output_tokens, "ignore_eos": true,
                                      "stream": true, "stream_options": {"include_usage": true}});
                if !self.tools.is_empty() {
                    let tools: Vec<Value> = self
                        .tools
                        .iter()
                        .map(|t| json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.schema()}}))
                        .collect();
                    body["tools"] = tools.into();
                }
                body
            }
            Api::Messages => {
                let last = self.system.len().saturating_sub(1);
                let system: Vec<Value> = self
                    .system
                    .iter()
                    .enumerate()
                    .map(|(i, s)| {
                        if i == last { json!({"type": "text", "text": s, "cache_control": {"type": "ephemeral"}}) } else { json!({"type": "text", "text": s}) }
                    })
                    .collect();
                let messages: Vec<Value> = history
                    .iter()
                    .map(|e| match e {
                        Entry::User(t) => json!({"role": "user", "content": [{"type": "text", "text": t}]}),
                        Entry::Assistant { text, call } => {
                            let mut blocks = Vec::new();
                            if !text.is_empty() || call.is_none() {
                                blocks.push(json!({"type": "text", "text": text}));
                            }
                            if let Some(c) = call {
                                blocks.push(json!({"type": "tool_use", "id": c.id, "name": c.name, "input": c.input()}));
                            }
                            json!({"role": "assistant", "content": blocks})
                        }
                        Entry::ToolResult { id, output } => json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": id, "content": output}]}),
                    })
                    .collect();
                let mut body = json!({"messages": messages, "max_tokens": self.output_tokens, "stream": true});
                if !system.is_empty() {
                    body["system"] = system.into();
                }
                if !self.tools.is_empty() {
                    let tools: Vec<Value> =
                        self.tools.iter().map(|t| json!({"name": t.name, "description": t.description, "input_schema": t.schema()})).collect();
                    body["tools"] = tools.into();
                }
                body
            }
        }
    }
}

/// What a run sends.
#[derive(Debug, Clone)]
pub enum Workload {
    /// Requests at fixed times, whatever the answers.
    Open(Vec<Job>),
    /// Conversations, each turn after the previous answer.
    Sessions(Vec<Session>),
}

impl Workload {
    /// Requests it will send.
    pub fn len(&self) -> usize {
        match self {
            Workload::Open(j) => j.len(),
            Workload::Sessions(s) => s.iter().map(|s| s.turns.len()).sum(),
        }
    }

    /// Whether it sends nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn completion(prompt: Value, max_tokens: usize) -> Value {
    // The prompt is moved into its place: `json!` would copy it.
    let mut body = json!({"prompt": null, "max_tokens": max_tokens.max(1), "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});
    body["prompt"] = prompt;
    body
}

/// How synthetic prompts are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptFormat {
    /// Token ids in `[10, vocab)`, sent as a token-id prompt.
    Ids,
    /// Text of one-token words ([`words`]), sent as a string prompt.
    Text,
}

/// Words that are exactly one token each, leading space included (`" cache"`), in vllm-sim's
/// built-in tokenizer, in vocabulary order. A text of n of them is n tokens there: byte-level
/// BPE splits before each space, and each word is its own token.
pub fn words() -> &'static [String] {
    static WORDS: OnceLock<Vec<String>> = OnceLock::new();
    WORDS.get_or_init(|| {
        let tok = kvgate_tokenize::tokenizer::ModelTokenizer::builtin();
        tok.output_vocab()
            .iter()
            .map(|&id| (id, tok.token_text(id)))
            .filter(|(_, t)| t.len() >= 3 && t.starts_with(' ') && t[1..].bytes().all(|b| b.is_ascii_lowercase()))
            .filter(|(id, t)| tok.encode(t, false).is_ok_and(|ids| ids == [*id]))
            .map(|(_, t)| t.to_string())
            .collect()
    })
}

/// A prompt under construction: token ids or text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Token ids.
    Ids(Vec<u32>),
    /// Text, one token per word in the built-in tokenizer.
    Text(String),
}

impl Prompt {
    /// An empty prompt in `format`.
    pub fn new(format: PromptFormat) -> Self {
        match format {
            PromptFormat::Ids => Prompt::Ids(Vec::new()),
            PromptFormat::Text => Prompt::Text(String::new()),
        }
    }

    /// Appends `n` tokens drawn from `rng`: ids in `[10, vocab)`, or words of [`words`].
    pub fn draw(&mut self, rng: &mut Rng, n: usize, vocab: u32) {
        match self {
            Prompt::Ids(ids) => {
                let span = u64::from(vocab.max(11) - 10);
                ids.extend((0..n).map(|_| 10 + (rng.next_u64() % span) as u32));
            }
            Prompt::Text(text) => {
                let w = words();
                for _ in 0..n {
                    text.push_str(&w[(rng.next_u64() % w.len() as u64) as usize]);
                }
            }
        }
    }

    /// Appends `other` (of the same format).
    pub fn extend(&mut self, other: &Prompt) {
        match (self, other) {
            (Prompt::Ids(a), Prompt::Ids(b)) => a.extend_from_slice(b),
            (Prompt::Text(a), Prompt::Text(b)) => a.push_str(b),
            _ => unreachable!("prompts of one workload share a format"),
        }
    }

    /// Its length in tokens (words for text).
    pub fn tokens(&self) -> usize {
        match self {
            Prompt::Ids(ids) => ids.len(),
            Prompt::Text(text) => text.bytes().filter(|&b| b == b' ').count(),
        }
    }

    /// The `prompt` field of a completion request.
    pub fn into_json(self) -> Value {
        match self {
            Prompt::Ids(ids) => json!(ids),
            Prompt::Text(text) => Value::String(text),
        }
    }
}

/// The next exponential gap, seconds, of a Poisson process at `rate` per second.
fn poisson_gap(rng: &mut Rng, rate: f64) -> f64 {
    // -ln(U) / rate, U in (0, 1].
    let u = ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    -u.ln() / rate.max(1e-9)
}

/// A trace replay: arrivals divided by `speedup`, at most `max_requests`, prompts cut to
/// `max_isl` tokens and outputs to `max_osl`, token ids below `vocab`.
pub fn from_trace(t: &[TraceRequest], format: PromptFormat, speedup: f64, (max_requests, max_isl, max_osl): (usize, usize, usize), vocab: u32) -> Workload {
    let speedup = if speedup > 0.0 { speedup } else { 1.0 };
    Workload::Open(
        t.iter()
            .take(max_requests)
            .map(|r| Job {
                at: Duration::from_secs_f64(r.timestamp as f64 / 1000.0 / speedup),
                path: "/v1/completions",
                body: completion(trace_prompt(r, format, vocab, max_isl).into_json(), r.output_length.min(max_osl)),
            })
            .collect(),
    )
}

/// The prompt of trace request `r` in `format`, cut to `max_tokens`: token ids as
/// [`trace::prompt`] builds them, or text where each hash id's block is as many words drawn
/// from the same generator, so equal ids give equal text and a shared prefix stays shared.
pub fn trace_prompt(r: &TraceRequest, format: PromptFormat, vocab: u32, max_tokens: usize) -> Prompt {
    if format == PromptFormat::Ids {
        return Prompt::Ids(trace::prompt(r, vocab, max_tokens));
    }
    let mut left = r.input_length.min(max_tokens);
    let mut p = Prompt::new(format);
    for &id in &r.hash_ids {
        let n = left.min(trace::TRACE_BLOCK);
        if n == 0 {
            break;
        }
        p.draw(&mut trace::block_rng(id), n, vocab);
        left -= n;
    }
    p
}

/// Shared-prefix traffic: `groups` prefixes of `prefix_tokens`, each request one of them
/// (uniformly) plus `suffix_tokens` of its own; Poisson arrivals at `rate` per second.
#[derive(Debug, Clone, Copy)]
pub struct SharedPrefix {
    /// Token ids or text.
    pub format: PromptFormat,
    /// Distinct prefixes.
    pub groups: u32,
    /// Prefix length, tokens.
    pub prefix_tokens: usize,
    /// Unique suffix length, tokens.
    pub suffix_tokens: usize,
    /// Output tokens per request.
    pub output_tokens: usize,
    /// Requests.
    pub requests: usize,
    /// Arrivals per second.
    pub rate: f64,
    /// Token ids are below this.
    pub vocab: u32,
    /// Seed of the arrivals and suffixes.
    pub seed: u64,
}

/// The requests of `w`.
pub fn shared_prefix(w: SharedPrefix) -> Workload {
    let SharedPrefix { format, groups, prefix_tokens, suffix_tokens, output_tokens, requests, rate, vocab, seed } = w;
    let mut rng = Rng::seeded(seed);
    let mut at = 0.0f64;
    let jobs = (0..requests)
        .map(|_| {
            let g = (rng.next_u64() % u64::from(groups.max(1))) as u32;
            let mut prompt = Prompt::new(format);
            prompt.draw(&mut Rng(u64::from(g).wrapping_mul(kvgate_kv::hash::PHI) | 1), prefix_tokens, vocab);
            prompt.draw(&mut rng, suffix_tokens, vocab);
            at += poisson_gap(&mut rng, rate);
            Job { at: Duration::from_secs_f64(at), path: "/v1/completions", body: completion(prompt.into_json(), output_tokens) }
        })
        .collect();
    Workload::Open(jobs)
}

/// A mix of short chat-like prompts and long documents, open loop with Poisson arrivals.
///
/// Short requests (`1 − long_fraction` of them) continue one of `conversations` ongoing
/// conversations: a system prompt shared by all of them, the conversation's earlier turns, and
/// a new turn, so a conversation's next prompt extends its previous one; a conversation that
/// would outgrow `short_tokens.1` starts over. Long requests ask a question about one of `docs`
/// documents (uniformly): the document, the same for every question about it, and the
/// question, unique; documents are re-asked, so their prefixes can be reused.
#[derive(Debug, Clone, Copy)]
pub struct Mixed {
    /// Token ids or text.
    pub format: PromptFormat,
    /// Requests.
    pub requests: usize,
    /// Arrivals per second.
    pub rate: f64,
    /// Fraction of requests that are long documents.
    pub long_fraction: f64,
    /// Short prompts' length range, tokens (inclusive).
    pub short_tokens: (usize, usize),
    /// Conversations the short requests continue.
    pub conversations: usize,
    /// Documents' length range, tokens (inclusive, question included).
    pub doc_tokens: (usize, usize),
    /// Distinct documents.
    pub docs: u32,
    /// Output tokens per request.
    pub output_tokens: usize,
    /// Token ids are below this.
    pub vocab: u32,
    /// Seed of everything.
    pub seed: u64,
}

/// The requests of `m`.
pub fn mixed(m: Mixed) -> Workload {
    let Mixed { format, requests, rate, long_fraction, short_tokens, conversations, doc_tokens, docs, output_tokens, vocab, seed } = m;
    let (short_min, short_max) = (short_tokens.0.max(1), short_tokens.1.max(short_tokens.0).max(1));
    let (doc_min, doc_max) = (doc_tokens.0.max(1), doc_tokens.1.max(doc_tokens.0).max(1));
    // A system prompt of a fifth of the shortest prompt, and turns sized so that a first turn
    // lands in the range and a conversation grows a few turns before it starts over.
    let system_tokens = short_min / 5;
    let turn = (short_min - system_tokens, ((short_max - short_min) / 4).max(short_min - system_tokens));
    let question = 32.min(doc_min / 2).max(1);
    let uniform = |rng: &mut Rng, (lo, hi): (usize, usize)| lo + (rng.next_u64() % (hi - lo + 1) as u64) as usize;
    let mut rng = Rng::seeded(seed);
    let mut system = Prompt::new(format);
    system.draw(&mut Rng::stream(seed, u64::MAX), system_tokens, vocab);
    let mut convs: Vec<Prompt> = vec![system.clone(); conversations.max(1)];
    let mut at = 0.0f64;
    let jobs = (0..requests)
        .map(|_| {
            at += poisson_gap(&mut rng, rate);
            let long = ((rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < long_fraction;
            let prompt = if long {
                let d = rng.next_u64() % u64::from(docs.max(1));
                let mut doc_rng = Rng::stream(seed, d);
                let len = uniform(&mut doc_rng, (doc_min, doc_max));
                let mut p = Prompt::new(format);
                p.draw(&mut doc_rng, len - question, vocab);
                p.draw(&mut rng, question, vocab);
                p
            } else {
                let c = (rng.next_u64() % convs.len() as u64) as usize;
                let mut next = Prompt::new(format);
                let len = uniform(&mut rng, turn).min(short_max - system_tokens);
                next.draw(&mut rng, len, vocab);
                if convs[c].tokens() + next.tokens() > short_max {
                    convs[c] = system.clone();
                }
                convs[c].extend(&next);
                convs[c].clone()
            };
            Job { at: Duration::from_secs_f64(at), path: "/v1/completions", body: completion(prompt.into_json(), output_tokens) }
        })
        .collect();
    Workload::Open(jobs)
}

/// Multi-turn chat: `sessions` conversations of `turns` turns, starting `1/rate` s apart.
#[derive(Debug, Clone, Copy)]
pub struct ChatSessions {
    /// Conversations.
    pub sessions: usize,
    /// User turns per conversation.
    pub turns: usize,
    /// Words per user turn.
    pub words_per_turn: usize,
    /// Words of the system prompt all sessions share.
    pub system_words: usize,
    /// Output tokens per turn.
    pub output_tokens: u32,
    /// Sessions started per second.
    pub rate: f64,
    /// Pause between an answer and the next turn.
    pub think: Duration,
    /// Seed of the texts.
    pub seed: u64,
}

/// The sessions of `c`.
pub fn chat_sessions(c: ChatSessions) -> Workload {
    let ChatSessions { sessions, turns, words_per_turn, system_words, output_tokens, rate, think, seed } = c;
    const WORDS: &[&str] = &["cache", "token", "worker", "prefix", "route", "block", "latency", "stream", "model", "queue", "batch", "decode"];
    let mut rng = Rng::seeded(seed);
    let words = |n: usize, rng: &mut Rng| (0..n).map(|_| WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]).collect::<Vec<_>>().join(" ");
    let system = format!("You are a helpful assistant. {}", words(system_words, &mut rng));
    Workload::Sessions(
        (0..sessions)
            .map(|i| Session {
                start: Duration::from_secs_f64(i as f64 / rate.max(1e-9)),
                system: vec![system.clone()],
                tools: Vec::new(),
                turns: (0..turns).map(|t| Turn::User(format!("Turn {t} of conversation {i}: {}", words(words_per_turn, &mut rng)))).collect(),
                output_tokens,
                think,
            })
            .collect(),
    )
}

/// Multi-turn agent sessions, as a coding agent drives a model: a long system prompt and a
/// tool list shared by every session, a task from the user, then turns that return the result
/// of a tool call the client appends to the model's previous answer (every
/// `user_every`-th turn is a user follow-up instead). Text of one-token words ([`words`]), so
/// sizes are tokens of vllm-sim's built-in tokenizer.
#[derive(Debug, Clone, Copy)]
pub struct AgentSessions {
    /// Conversations.
    pub sessions: usize,
    /// Turns per conversation (the first is the user's task).
    pub turns: usize,
    /// Tokens of the shared system prompt (before the tools).
    pub system_tokens: usize,
    /// Tools offered (shared).
    pub tools: usize,
    /// Tokens of a user message.
    pub user_tokens: usize,
    /// Tokens of a tool result (each between half and 1.5 times this).
    pub tool_result_tokens: usize,
    /// Every this many turns a user follow-up instead of a tool result (0: never).
    pub user_every: usize,
    /// Output tokens per turn.
    pub output_tokens: u32,
    /// Sessions started per second.
    pub rate: f64,
    /// Pause between an answer and the next turn.
    pub think: Duration,
    /// Seed of everything.
    pub seed: u64,
}

/// Tool names of the agent workload (more tools are numbered).
const TOOL_NAMES: [&str; 12] = [
    "read_file",
    "write_file",
    "edit_file",
    "list_directory",
    "search_code",
    "run_command",
    "run_tests",
    "git_diff",
    "git_log",
    "web_fetch",
    "todo_write",
    "ask_user",
];

/// Parameter names the agent workload's tools draw from.
const PARAM_NAMES: [&str; 8] = ["path", "pattern", "command", "content", "query", "revision", "url", "timeout"];

/// The sessions of `a`.
pub fn agent_sessions(a: AgentSessions) -> Workload {
    let text = |rng: &mut Rng, n: usize| {
        let mut p = Prompt::new(PromptFormat::Text);
        p.draw(rng, n, 0);
        let Prompt::Text(t) = p else { unreachable!("a text prompt") };
        t
    };
    // The shared parts come from sub-streams of the seed, the sessions' own from the main one.
    let mut shared = Rng::stream(a.seed, u64::MAX - 1);
    let system = vec![
        "You are an interactive coding agent. Use the tools below to help the user with software engineering tasks.".to_string(),
        format!("\n\n# Guidelines\n{}", text(&mut shared, a.system_tokens)),
    ];
    let tools: Vec<Tool> = (0..a.tools)
        .map(|k| {
            let name = TOOL_NAMES.get(k).map_or_else(|| format!("tool_{k}"), |n| (*n).to_string());
            let n_params = 1 + (shared.next_u64() % 3) as usize;
            let first = (shared.next_u64() % PARAM_NAMES.len() as u64) as usize;
            let params =
                (0..n_params).map(|j| (PARAM_NAMES[(first + j) % PARAM_NAMES.len()].to_string(), text(&mut shared, 8).trim_start().to_string())).collect();
            Tool { name, description: text(&mut shared, 40).trim_start().to_string(), params }
        })
        .collect();
    let mut rng = Rng::seeded(a.seed);
    Workload::Sessions(
        (0..a.sessions)
            .map(|i| {
                let turns = (0..a.turns)
                    .map(|t| {
                        if t == 0 {
                            return Turn::User(format!("Task {i}:{}", text(&mut rng, a.user_tokens)));
                        }
                        if (a.user_every > 0 && t % a.user_every == 0) || tools.is_empty() {
                            return Turn::User(text(&mut rng, a.user_tokens).trim_start().to_string());
                        }
                        let tool = &tools[(rng.next_u64() % tools.len() as u64) as usize];
                        let input = tool.params.iter().map(|(p, _)| (p.clone(), text(&mut rng, 4).trim_start().to_string())).collect();
                        let call = ToolCall { id: format!("toolu_{i:04}_{t:03}"), name: tool.name.clone(), input };
                        let n = a.tool_result_tokens / 2 + (rng.next_u64() % (a.tool_result_tokens as u64 + 1)) as usize;
                        Turn::ToolResult { call, output: text(&mut rng, n.max(1)).trim_start().to_string() }
                    })
                    .collect();
                Session {
                    start: Duration::from_secs_f64(i as f64 / a.rate.max(1e-9)),
                    system: system.clone(),
                    tools: tools.clone(),
                    turns,
                    output_tokens: a.output_tokens,
                    think: a.think,
                }
            })
            .collect(),
    )
}

/// The tokenizer the agent workload is served with: vllm-sim's built-in one (`tokenizer.json`
/// and `tokenizer_config.json` as shipped) with a chat template that prints tools and tool calls
/// (`chat_template.jinja`, Qwen2.5's), written into `dir`, for both the workers (`--tokenizer`)
/// and kvgate (`tokenizer:`), so that tools and tool calls are part of the prompt and the two
/// render it alike.
pub fn write_agent_tokenizer(dir: &std::path::Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("tokenizer.json"), include_str!("../../../tokenize/assets/tokenizer/tokenizer.json"))?;
    std::fs::write(dir.join("tokenizer_config.json"), include_str!("../../../tokenize/assets/tokenizer/tokenizer_config.json"))?;
    std::fs::write(dir.join("chat_template.jinja"), AGENT_TEMPLATE)
}

/// The agent workload's chat template.
pub const AGENT_TEMPLATE: &str = include_str!("agent_template.jinja");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefix_requests_share_their_groups_prefix_and_arrive_at_the_rate() {
        let w = SharedPrefix {
            format: PromptFormat::Ids,
            groups: 4,
            prefix_tokens: 64,
            suffix_tokens: 8,
            output_tokens: 5,
            requests: 2000,
            rate: 100.0,
            vocab: 1000,
            seed: 7,
        };
        let Workload::Open(jobs) = shared_prefix(w) else { panic!() };
        let prompt = |j: &Job| j.body["prompt"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect::<Vec<_>>();
        let prefixes: std::collections::HashSet<Vec<u64>> = jobs.iter().map(|j| prompt(j)[..64].to_vec()).collect();
        assert_eq!(prefixes.len(), 4);
        assert!(jobs.iter().all(|j| prompt(j).len() == 72));
        let span = jobs.last().unwrap().at.as_secs_f64();
        assert!((span - 20.0).abs() < 2.0, "2000 requests at 100/s take about 20 s: {span}");
        assert!(jobs.windows(2).all(|w| w[0].at <= w[1].at));
    }

    fn prompt_of(j: &Job) -> Prompt {
        match &j.body["prompt"] {
            Value::String(t) => Prompt::Text(t.clone()),
            Value::Array(a) => Prompt::Ids(a.iter().map(|v| v.as_u64().unwrap() as u32).collect()),
            other => panic!("{other}"),
        }
    }

    fn words_of(p: &Prompt) -> Vec<String> {
        match p {
            Prompt::Text(t) => t.split(' ').skip(1).map(str::to_string).collect(),
            Prompt::Ids(ids) => ids.iter().map(u32::to_string).collect(),
        }
    }

    #[test]
    fn text_prompts_are_one_token_per_word_in_the_builtin_tokenizer() {
        let w = words();
        assert!(w.len() >= 200, "a varied pool: {}", w.len());
        let tok = kvgate_tokenize::tokenizer::ModelTokenizer::builtin();
        let mut p = Prompt::new(PromptFormat::Text);
        p.draw(&mut Rng(3), 500, 0);
        assert_eq!(p.tokens(), 500);
        let Prompt::Text(text) = &p else { panic!() };
        assert_eq!(tok.encode(text, false).unwrap().len(), 500);
        // A shared text prefix is a shared token prefix.
        let mut q = p.clone();
        q.draw(&mut Rng(4), 20, 0);
        let Prompt::Text(longer) = &q else { panic!() };
        let (a, b) = (tok.encode(text, false).unwrap(), tok.encode(longer, false).unwrap());
        assert_eq!(a[..], b[..500]);
    }

    #[test]
    fn shared_prefix_text_keeps_the_groups_and_lengths() {
        let w = SharedPrefix {
            format: PromptFormat::Text,
            groups: 32,
            prefix_tokens: 384,
            suffix_tokens: 128,
            output_tokens: 8,
            requests: 600,
            rate: 50.0,
            vocab: 4000,
            seed: 42,
        };
        let Workload::Open(jobs) = shared_prefix(w) else { panic!() };
        let prompts: Vec<Vec<String>> = jobs.iter().map(|j| words_of(&prompt_of(j))).collect();
        assert!(prompts.iter().all(|p| p.len() == 512));
        let prefixes: std::collections::HashSet<&[String]> = prompts.iter().map(|p| &p[..384]).collect();
        assert_eq!(prefixes.len(), 32, "every group shows up in 600 requests");
        let suffixes: std::collections::HashSet<&[String]> = prompts.iter().map(|p| &p[384..]).collect();
        assert_eq!(suffixes.len(), 600, "suffixes are unique");
        let Workload::Open(again) = shared_prefix(w) else { panic!() };
        assert!(jobs.iter().zip(&again).all(|(a, b)| a.body == b.body && a.at == b.at), "deterministic");
        let Workload::Open(other) = shared_prefix(SharedPrefix { seed: 43, ..w }) else { panic!() };
        assert_ne!(jobs[0].body, other[0].body);
    }

    fn mixed_default(format: PromptFormat, seed: u64) -> Mixed {
        Mixed {
            format,
            requests: 2000,
            rate: 20.0,
            long_fraction: 0.2,
            short_tokens: (100, 500),
            conversations: 32,
            doc_tokens: (4096, 16384),
            docs: 24,
            output_tokens: 64,
            vocab: 4000,
            seed,
        }
    }

    #[test]
    fn mixed_has_the_proportions_sizes_and_reuse_asked_for() {
        for format in [PromptFormat::Ids, PromptFormat::Text] {
            let Workload::Open(jobs) = mixed(mixed_default(format, 42)) else { panic!() };
            assert_eq!(jobs.len(), 2000);
            let prompts: Vec<Vec<String>> = jobs.iter().map(|j| words_of(&prompt_of(j))).collect();
            let (long, short): (Vec<&Vec<String>>, Vec<&Vec<String>>) = prompts.iter().partition(|p| p.len() >= 4096);
            assert!(short.iter().all(|p| (100..=500).contains(&p.len())), "{format:?}: short prompts of 100-500 tokens");
            assert!(long.iter().all(|p| (4096..=16384).contains(&p.len())), "{format:?}: documents of 4k-16k tokens");
            let frac = long.len() as f64 / 2000.0;
            assert!((frac - 0.2).abs() < 0.03, "{format:?}: long fraction {frac}");
            // Short prompts span the range.
            assert!(short.iter().any(|p| p.len() < 150) && short.iter().any(|p| p.len() > 400));
            // Documents are re-asked: 24 distinct documents (first 4,000 tokens), questions unique.
            let docs: std::collections::HashSet<&[String]> = long.iter().map(|p| &p[..4000]).collect();
            assert_eq!(docs.len(), 24, "{format:?}");
            let asked: std::collections::HashSet<&Vec<String>> = long.iter().copied().collect();
            assert_eq!(asked.len(), long.len(), "each question is unique");
            // Short prompts share the system prompt, and conversations extend earlier prompts.
            let system = &short[0][..20];
            assert!(short.iter().all(|p| &p[..20] == system));
            let extended = short.windows(2).filter(|w| w[1].len() > w[0].len()).count();
            let continued = short.iter().enumerate().filter(|(i, p)| short[..*i].iter().any(|q| q.len() < p.len() && p.starts_with(q))).count();
            assert!(extended > 0 && continued > short.len() / 2, "{format:?}: most short prompts continue a conversation ({continued})");
            // Poisson at 20/s: 2,000 requests in about 100 s, in order.
            let span = jobs.last().unwrap().at.as_secs_f64();
            assert!((span - 100.0).abs() < 10.0, "{span}");
            assert!(jobs.windows(2).all(|w| w[0].at <= w[1].at));
        }
        let Workload::Open(a) = mixed(mixed_default(PromptFormat::Text, 7)) else { panic!() };
        let Workload::Open(b) = mixed(mixed_default(PromptFormat::Text, 7)) else { panic!() };
        let Workload::Open(c) = mixed(mixed_default(PromptFormat::Text, 8)) else { panic!() };
        assert!(a.iter().zip(&b).all(|(x, y)| x.body == y.body && x.at == y.at), "same seed, same workload");
        assert!(a.iter().zip(&c).any(|(x, y)| x.body != y.body), "another seed, another workload");
    }

    fn agent_default(seed: u64) -> AgentSessions {
        AgentSessions {
            sessions: 6,
            turns: 9,
            system_tokens: 300,
            tools: 5,
            user_tokens: 20,
            tool_result_tokens: 40,
            user_every: 4,
            output_tokens: 16,
            rate: 2.0,
            think: Duration::from_millis(10),
            seed,
        }
    }

    #[test]
    fn agent_sessions_share_their_prefix_and_alternate_tool_results_with_follow_ups() {
        let Workload::Sessions(s) = agent_sessions(agent_default(42)) else { panic!() };
        assert_eq!(s.len(), 6);
        assert!(s.iter().all(|x| x.system == s[0].system && x.tools == s[0].tools), "shared system prompt and tools");
        assert_eq!(s[0].tools.len(), 5);
        assert_eq!(s[0].tools[0].name, "read_file");
        assert!(s[0].system[1].matches(' ').count() >= 300, "the system prompt's words: {}", s[0].system[1]);
        for x in &s {
            assert!(matches!(x.turns[0], Turn::User(_)));
            for (t, turn) in x.turns.iter().enumerate().skip(1) {
                match turn {
                    Turn::User(_) => assert_eq!(t % 4, 0, "a follow-up every 4th turn"),
                    Turn::ToolResult { call, output } => {
                        assert_ne!(t % 4, 0);
                        assert!(x.tools.iter().any(|tool| tool.name == call.name && tool.params.len() == call.input.len()));
                        assert!((20..=60).contains(&(output.matches(' ').count() + 1)), "{output}");
                    }
                }
            }
        }
        let Workload::Sessions(again) = agent_sessions(agent_default(42)) else { panic!() };
        assert!(s.iter().zip(&again).all(|(a, b)| a.turns == b.turns && a.system == b.system && a.tools == b.tools), "deterministic");
        let Workload::Sessions(other) = agent_sessions(agent_default(43)) else { panic!() };
        assert_ne!(s[0].turns, other[0].turns);
        assert_ne!(s[0].system, other[0].system);
        assert_eq!(s[1].start, Duration::from_millis(500));
    }

    /// The chat and Messages forms of every turn of every session render to the same prompt,
    /// the way vllm-sim, kvgate and vLLM render them (a Messages request converted to chat,
    /// then the template), with tools, tool calls and tool results printed by the agent
    /// template, and with the chat workload's plain template too.
    #[test]
    fn a_session_renders_alike_as_chat_and_as_messages() {
        use kvgate_tokenize::dialect::{self, messages};
        let dir = std::env::temp_dir().join(format!("kvgate-bench-agent-tokenizer-{}", std::process::id()));
        write_agent_tokenizer(&dir).unwrap();
        let agent_tok = kvgate_tokenize::ModelTokenizer::load(&dir).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let builtin = kvgate_tokenize::ModelTokenizer::builtin();
        let chat = chat_sessions(ChatSessions {
            sessions: 2,
            turns: 3,
            words_per_turn: 10,
            system_words: 20,
            output_tokens: 8,
            rate: 1.0,
            think: Duration::ZERO,
            seed: 1,
        });
        for (w, tok) in [(agent_sessions(agent_default(42)), &agent_tok), (chat, &builtin)] {
            let opts = messages::MessagesOptions::for_tokenizer(tok);
            let Workload::Sessions(sessions) = w else { panic!() };
            for s in &sessions {
                let mut answers = Vec::new();
                for t in 0..s.turns.len() {
                    let h = s.history(&answers);
                    assert_eq!(h.len(), 2 * t + 1);
                    let mut as_chat = s.request(Api::Chat, &h);
                    let mut as_messages = s.request(Api::Messages, &h);
                    as_chat["model"] = "m".into();
                    as_messages["model"] = "m".into();
                    let a = dialect::render_chat(tok, &as_chat).unwrap();
                    let b = dialect::render_chat(tok, &messages::to_chat(&as_messages, &opts).unwrap()).unwrap();
                    assert_eq!(a, b, "turn {t}");
                    assert_eq!(tok.encode(&a, false).unwrap(), tok.encode(&b, false).unwrap());
                    assert!(a.ends_with("<|im_start|>assistant\n"), "{a}");
                    if !s.tools.is_empty() {
                        assert!(a.contains("<tools>") && a.contains("\"name\": \"read_file\""), "tools printed: {a}");
                        if t > 1 {
                            assert!(a.contains("<tool_call>") && a.contains("<tool_response>"), "calls and results printed: {a}");
                        }
                    }
                    answers.push(format!(" answer {t} with some text"));
                }
                // A later turn's prompt extends an earlier one's (what the prefix cache reuses),
                // up to the generation prompt.
                let full = dialect::render_chat(tok, &s.request(Api::Chat, &s.history(&answers[..answers.len() - 1]))).unwrap();
                let first = dialect::render_chat(tok, &s.request(Api::Chat, &s.history(&[]))).unwrap();
                assert!(full.starts_with(first.trim_end_matches("<|im_start|>assistant\n")));
            }
        }
    }

    #[test]
    fn a_trace_replay_is_time_scaled_and_capped() {
        let t = vec![
            TraceRequest { timestamp: 0, input_length: 700, output_length: 9, hash_ids: vec![1, 2] },
            TraceRequest { timestamp: 10_000, input_length: 600, output_length: 3000, hash_ids: vec![1, 3] },
        ];
        let Workload::Open(jobs) = from_trace(&t, PromptFormat::Ids, 10.0, (10, 512, 100), 5000) else { panic!() };
        assert_eq!(jobs[1].at, Duration::from_secs(1));
        assert_eq!(jobs[0].body["prompt"].as_array().unwrap().len(), 512);
        assert_eq!(jobs[1].body["max_tokens"], 100);
        assert_eq!(jobs[0].body["prompt"], jobs[1].body["prompt"], "same first block, cut to it");
    }

    #[test]
    fn a_trace_replayed_as_text_keeps_its_lengths_and_shared_prefixes_in_tokens() {
        let tok = kvgate_tokenize::tokenizer::ModelTokenizer::builtin();
        let a = TraceRequest { timestamp: 0, input_length: 700, output_length: 9, hash_ids: vec![1, 2] };
        let b = TraceRequest { timestamp: 0, input_length: 900, output_length: 9, hash_ids: vec![1, 3] };
        let ids = |r: &TraceRequest, cut: usize| {
            let Prompt::Text(text) = trace_prompt(r, PromptFormat::Text, 5000, cut) else { panic!("text") };
            tok.encode(&text, false).unwrap()
        };
        let (ta, tb) = (ids(&a, usize::MAX), ids(&b, usize::MAX));
        assert_eq!((ta.len(), tb.len()), (700, 900));
        assert_eq!(ta[..512], tb[..512], "the shared first block");
        assert_ne!(ta[512..700], tb[512..700]);
        assert_eq!(ids(&a, 600), ta[..600], "cut to a prefix");
    }
}
