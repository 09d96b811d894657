//! Renders a HF chat template (Jinja) the way vLLM/transformers do, with minijinja.
//!
//! The environment is built once per template, configured as transformers configures Jinja2
//! (`trim_blocks`, `lstrip_blocks`, and a `tojson` that is Python's `json.dumps`: `", "`
//! separators, no HTML escaping, `indent`/`sort_keys`/`ensure_ascii` honoured). Python-compatible
//! string/dict methods come from `minijinja_contrib::pycompat`; `raise_exception` and
//! `strftime_now` are provided here because HF templates call them. Message `content` given as a list of parts is flattened to its text
//! parts joined by newlines, as vLLM does for templates that expect string content.

use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;
use std::fmt::Write as _;

/// Inputs of one render.
#[derive(Debug, Serialize)]
pub struct ChatInput<'a> {
    /// OpenAI messages (content already normalised by [`normalize_messages`]).
    pub messages: &'a [serde_json::Value],
    /// Append the assistant turn header.
    pub add_generation_prompt: bool,
    /// Tool definitions, passed through.
    pub tools: Option<&'a serde_json::Value>,
    /// Extra variables (`chat_template_kwargs`).
    #[serde(skip)]
    pub kwargs: Option<&'a serde_json::Map<String, serde_json::Value>>,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error is reported with its message.
    pub fn new(source: String) -> Result<Self, String> {
        let mut env = Environment::new();
        let syntax =
            minijinja::syntax::SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build().map_err(|e| format!("chat template syntax: {e}"))?;
        env.set_syntax(syntax);
        env.add_filter("tojson", tojson);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> { Err(Error::new(ErrorKind::InvalidOperation, msg)) });
        env.add_function("strftime_now", |fmt: String| strftime_now(&fmt));
        env.add_template_owned("chat", source).map_err(|e| format!("chat template does not compile: {e}"))?;
        Ok(Self { env })
    }

    /// Renders the prompt text.
    pub fn render(&self, input: &ChatInput<'_>, bos: Option<&str>, eos: Option<&str>) -> Result<String, String> {
        let tmpl = self.env.get_template("chat").map_err(|e| e.to_string())?;
        let mut ctx = serde_json::Map::new();
        if let Some(kw) = input.kwargs {
            ctx.extend(kw.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        ctx.insert("messages".into(), serde_json::Value::Array(input.messages.to_vec()));
        ctx.insert("add_generation_prompt".into(), input.add_generation_prompt.into());
        if let Some(t) = input.tools {
            ctx.insert("tools".into(), t.clone());
        }
        ctx.insert("bos_token".into(), bos.unwrap_or("").into());
        ctx.insert("eos_token".into(), eos.unwrap_or("").into());
        tmpl.render(Value::from(minijinja::value::Serde(&ctx))).map_err(|e| format!("chat template error: {e}"))
    }
}

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=…, sort_keys=…)`.
#[allow(clippy::needless_pass_by_value, reason = "minijinja hands a filter its keyword arguments by value only")]
fn tojson(value: &Value, kwargs: minijinja::value::Kwargs) -> Result<Value, Error> {
    let json = serde_json::to_value(value).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let indent: Option<usize> = kwargs.get("indent")?;
    let opts = crate::dialect::python::Dumps {
        ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        indent,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    Ok(Value::from_safe_string(crate::dialect::python::json_dumps_with(&json, &opts)))
}

/// Validates OpenAI messages and flattens list-of-parts content into text.
pub fn normalize_messages(messages: &[serde_json::Value]) -> Result<Vec<serde_json::Value>, String> {
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let Some(obj) = m.as_object() else {
            return Err(format!("messages[{i}] must be an object"));
        };
        if !obj.get("role").is_some_and(|r| r.is_string()) {
            return Err(format!("messages[{i}].role must be a string"));
        }
        let mut obj = obj.clone();
        let content = match obj.get("content") {
            None | Some(serde_json::Value::Null) => serde_json::Value::String(String::new()),
            Some(serde_json::Value::String(s)) => serde_json::Value::String(s.clone()),
            Some(serde_json::Value::Array(parts)) => {
                let mut texts = Vec::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.get("type").and_then(|t| t.as_str()), p.get("text").and_then(|t| t.as_str())) {
                        (Some("text"), Some(t)) => texts.push(t.to_owned()),
                        (Some("text"), None) => return Err(format!("messages[{i}].content[{j}].text must be a string")),
                        (Some(other), _) => {
                            return Err(format!("messages[{i}].content[{j}]: content part type '{other}' is not supported by this model"));
                        }
                        (None, _) => return Err(format!("messages[{i}].content[{j}].type is required")),
                    }
                }
                serde_json::Value::String(texts.join("\n"))
            }
            Some(_) => return Err(format!("messages[{i}].content must be a string or a list of parts")),
        };
        obj.insert("content".into(), content);
        out.push(serde_json::Value::Object(obj));
    }
    Ok(out)
}

/// `strftime_now(fmt)` for templates (UTC; %Y %m %d %b %B %H %M %S %%).
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    format_utc(secs, fmt)
}

fn format_utc(secs: u64, fmt: &str) -> String {
    const MONTHS: [&str; 12] = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
    // Civil-from-days (Howard Hinnant's algorithm).
    let days = i64::try_from(secs / 86_400).expect("u64::MAX / 86,400 fits an i64");
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let month = MONTHS[usize::try_from(m - 1).expect("a month within 1..=12")];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('m') => _ = write!(out, "{m:02}"),
            Some('d') => _ = write!(out, "{d:02}"),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('H') => _ = write!(out, "{:02}", rem / 3600),
            Some('M') => _ = write!(out, "{:02}", rem % 3600 / 60),
            Some('S') => _ = write!(out, "{:02}", rem % 60),
            Some('%') | None => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn renders_with_pycompat_and_generation_prompt() {
        let t = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}{{ m['role'].upper() }}:{{ m['content'].strip() }}\n{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}".into(),
        )
        .unwrap();
        let msgs = normalize_messages(&[json!({"role":"user","content":[{"type":"text","text":" hi "},{"type":"text","text":"there"}]})]).unwrap();
        let input = ChatInput { messages: &msgs, add_generation_prompt: true, tools: None, kwargs: None };
        assert_eq!(t.render(&input, Some("<s>"), None).unwrap(), "<s>USER:hi \nthere\nASSISTANT:");
    }

    #[test]
    fn blocks_are_trimmed_and_tojson_is_pythons() {
        // transformers renders with trim_blocks and lstrip_blocks.
        let t = ChatTemplate::new(
            "{% for m in messages %}\n  {% if true %}\n[{{ m['content'] }}]\n  {% endif %}\n{% endfor %}{{ tools | tojson }}|{{ tools | tojson(indent=1) }}"
                .into(),
        )
        .unwrap();
        let msgs = [json!({"role": "user", "content": "a<b"})];
        let tools = json!([{"n": "é<&>", "p": {}}]);
        let input = ChatInput { messages: &msgs, add_generation_prompt: false, tools: Some(&tools), kwargs: None };
        assert_eq!(t.render(&input, None, None).unwrap(), "[a<b]\n[{\"n\": \"é<&>\", \"p\": {}}]|[\n {\n  \"n\": \"é<&>\",\n  \"p\": {}\n }\n]");
    }

    #[test]
    fn raise_exception_is_an_error_not_a_panic() {
        let t = ChatTemplate::new("{{ raise_exception('only user roles') }}".into()).unwrap();
        let input = ChatInput { messages: &[], add_generation_prompt: false, tools: None, kwargs: None };
        assert!(t.render(&input, None, None).unwrap_err().contains("only user roles"));
    }

    #[test]
    fn bad_messages_are_rejected() {
        assert!(normalize_messages(&[json!("x")]).is_err());
        assert!(normalize_messages(&[json!({"content":"x"})]).is_err());
        assert!(normalize_messages(&[json!({"role":"user","content":[{"type":"image_url"}]})]).is_err());
    }

    #[test]
    fn formats_dates() {
        // 2024-07-23 12:34:56 UTC
        assert_eq!(format_utc(1_721_738_096, "%d %b %Y %H:%M:%S"), "23 Jul 2024 12:34:56");
    }
}
