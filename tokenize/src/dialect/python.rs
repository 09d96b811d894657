//! How Python spells a JSON value, where vLLM's conversion writes one into a string the chat
//! template sees: `json.dumps` (tool-call arguments) and `str()` of a list (an assistant
//! message's `tool_result` content). Rust's own formatting differs in separators, escapes and
//! float spelling, and the template renders the string verbatim.

use serde_json::Value;
use std::fmt::Write as _;

/// `json.dumps(v)` with Python's defaults (`", "` and `": "` separators, `ensure_ascii=True`),
/// or with `ensure_ascii=False` when `ascii` is false.
pub fn json_dumps(v: &Value, ascii: bool) -> String {
    json_dumps_with(v, &Dumps { ascii, ..Dumps::default() })
}

/// The `json.dumps` keyword arguments chat templates use (through transformers' `tojson`).
#[derive(Debug, Clone, Default)]
pub struct Dumps {
    /// `ensure_ascii`.
    pub ascii: bool,
    /// `indent`: items on their own lines, indented by this many spaces per level.
    pub indent: Option<usize>,
    /// `sort_keys`.
    pub sort_keys: bool,
}

/// `json.dumps(v, ensure_ascii=…, indent=…, sort_keys=…)`.
pub fn json_dumps_with(v: &Value, opts: &Dumps) -> String {
    let mut out = String::new();
    write_json(&mut out, v, opts, 0);
    out
}

fn write_json(out: &mut String, v: &Value, opts: &Dumps, depth: usize) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => write_number(out, n, "Infinity"),
        Value::String(s) => write_json_str(out, s, opts.ascii),
        Value::Array(items) if items.is_empty() => out.push_str("[]"),
        Value::Object(map) if map.is_empty() => out.push_str("{}"),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                separate(out, opts, depth + 1, i > 0);
                write_json(out, item, opts, depth + 1);
            }
            separate(out, opts, depth, false);
            out.push(']');
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                separate(out, opts, depth + 1, i > 0);
                write_json_str(out, k, opts.ascii);
                out.push_str(": ");
                write_json(out, item, opts, depth + 1);
            }
            separate(out, opts, depth, false);
            out.push('}');
        }
    }
}

/// Python's item separator: `", "` on one line; with an indent, `","` then a new line indented
/// to `depth` (also before the first item and before the closing bracket).
fn separate(out: &mut String, opts: &Dumps, depth: usize, comma: bool) {
    if comma {
        out.push(',');
    }
    match opts.indent {
        Some(n) => {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
        None if comma => out.push(' '),
        None => {}
    }
}

fn write_json_str(out: &mut String, s: &str, ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `str(v)` / `repr(v)` of the Python object `json.loads` would make of `v`.
pub fn repr(v: &Value) -> String {
    let mut out = String::new();
    write_repr(&mut out, v);
    out
}

fn write_repr(out: &mut String, v: &Value) {
    match v {
        Value::Null => out.push_str("None"),
        Value::Bool(b) => out.push_str(if *b { "True" } else { "False" }),
        Value::Number(n) => write_number(out, n, "inf"),
        Value::String(s) => write_repr_str(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr_str(out, k);
                out.push_str(": ");
                write_repr(out, item);
            }
            out.push('}');
        }
    }
}

fn write_repr_str(out: &mut String, s: &str) {
    // Python quotes with ' unless the text holds a ' and no ".
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if c.is_control() => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Integers as they are; floats as Python's `repr(float)`: the shortest digits that round-trip,
/// positional from 1e-4 up to 1e16, scientific (`1e-05`, `1e+16`) outside.
fn write_number(out: &mut String, n: &serde_json::Number, inf: &str) {
    if n.is_i64() || n.is_u64() {
        out.push_str(&n.to_string());
        return;
    }
    let Some(f) = n.as_f64() else {
        out.push_str(&n.to_string());
        return;
    };
    if !f.is_finite() {
        out.push_str(if f.is_nan() {
            "NaN"
        } else if f > 0.0 {
            inf
        } else {
            "-inf"
        });
        return;
    }
    out.push_str(&py_float(f));
}

fn py_float(f: f64) -> String {
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // `{:e}` gives the shortest round-trip digits: "1.25e-7", "3e0".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if negative { "-" } else { "" };
    if !(-4..16).contains(&exp) {
        let (head, tail) = digits.split_at(1);
        let frac = if tail.is_empty() { String::new() } else { format!(".{tail}") };
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{head}{frac}e{esign}{:02}", exp.abs());
    }
    let point = exp + 1; // digits before the decimal point
    let body = match usize::try_from(point) {
        Ok(0) | Err(_) => format!("0.{}{digits}", "0".repeat(point.unsigned_abs() as usize)),
        Ok(point) if point >= digits.len() => format!("{digits}{}.0", "0".repeat(point - digits.len())),
        Ok(point) => {
            let (int, frac) = digits.split_at(point);
            format!("{int}.{frac}")
        }
    };
    format!("{sign}{body}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn dumps_like_python() {
        // json.dumps({"city": "Paris", "n": [1, 2.5, True, None], "é": "ü\n"})
        let v = json!({"city": "Paris", "n": [1, 2.5, true, null], "é": "ü\n"});
        assert_eq!(json_dumps(&v, true), r#"{"city": "Paris", "n": [1, 2.5, true, null], "\u00e9": "\u00fc\n"}"#);
        assert_eq!(json_dumps(&v, false), "{\"city\": \"Paris\", \"n\": [1, 2.5, true, null], \"é\": \"ü\\n\"}");
        assert_eq!(json_dumps(&json!({}), true), "{}");
        assert_eq!(json_dumps(&json!("😀"), true), r#""\ud83d\ude00""#);
        // json.dumps({"b": [1, {}], "a": []}, indent=2, sort_keys=True)
        let opts = Dumps { indent: Some(2), sort_keys: true, ..Dumps::default() };
        assert_eq!(json_dumps_with(&json!({"b": [1, {}], "a": []}), &opts), "{\n  \"a\": [],\n  \"b\": [\n    1,\n    {}\n  ]\n}");
    }

    #[test]
    fn reprs_like_python() {
        // str([{'type': 'text', 'text': "it's"}, 1.0, None, False])
        let v = json!([{"type": "text", "text": "it's"}, 1.0, null, false]);
        assert_eq!(repr(&v), r#"[{'type': 'text', 'text': "it's"}, 1.0, None, False]"#);
        assert_eq!(repr(&json!("a'b\"c\n")), r#"'a\'b"c\n'"#);
    }

    #[test]
    fn floats_like_python() {
        for (f, want) in [(1.0, "1.0"), (0.5, "0.5"), (1e-5, "1e-05"), (1e16, "1e+16"), (123456.789, "123456.789"), (0.0001, "0.0001"), (-2.5e-7, "-2.5e-07")] {
            assert_eq!(py_float(f), want, "{f}");
        }
    }
}
