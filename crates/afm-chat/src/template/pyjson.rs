//! Python-compatible text for template values. `tojson` as HF chat templates expect it: Python's
//! `json.dumps(x, ensure_ascii=False, indent=.., separators=.., sort_keys=..)`, byte for byte
//! (transformers overrides Jinja's HTML-escaping `tojson` with exactly this); and the output
//! formatter, which prints floats, lists and dicts as Python's `str()` does (`1e+20`,
//! `['a', None]`), where minijinja would print Rust/JSON forms.

use crate::tokenizer::unicode::{category, Category};
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};
use minijinja::{Output, State};
use std::fmt::Write;

pub(crate) struct Options {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

/// The `tojson` filter: `x | tojson(indent=2, separators=(",", ":"), sort_keys=true, ensure_ascii=true)`.
pub(crate) fn tojson_filter(
    value: &Value,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get::<Option<Value>>("indent")?.or(indent);
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) if v.kind() == ValueKind::Number => {
            Some(" ".repeat(i64::try_from(v.clone()).unwrap_or(0).clamp(0, 64) as usize))
        }
        Some(v) => Some(v.as_str().unwrap_or("").to_string()),
    };
    let (mut item_sep, key_sep) = if indent.is_some() {
        (",".to_string(), ": ".to_string())
    } else {
        (", ".to_string(), ": ".to_string())
    };
    let mut key_sep = key_sep;
    if let Some(seps) = kwargs.get::<Option<Value>>("separators")? {
        if !seps.is_none() {
            let parts: Vec<Value> = seps.try_iter()?.collect();
            if parts.len() != 2 {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be a pair",
                ));
            }
            item_sep = parts[0].as_str().unwrap_or(",").to_string();
            key_sep = parts[1].as_str().unwrap_or(":").to_string();
        }
    }
    let opts = Options {
        indent,
        item_sep,
        key_sep,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_value(&mut out, value, &opts, 0)?;
    Ok(Value::from(out))
}

/// Compact Python-style JSON (`json.dumps(x, ensure_ascii=False)`).
#[cfg(test)]
fn dumps(value: &Value) -> Result<String, Error> {
    let opts = Options {
        indent: None,
        item_sep: ", ".into(),
        key_sep: ": ".into(),
        sort_keys: false,
        ensure_ascii: false,
    };
    let mut out = String::new();
    write_value(&mut out, value, &opts, 0)?;
    Ok(out)
}

const MAX_DEPTH: usize = 128;

fn newline(out: &mut String, opts: &Options, depth: usize) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
}

fn write_value(out: &mut String, v: &Value, opts: &Options, depth: usize) -> Result<(), Error> {
    if depth > MAX_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nested too deeply",
        ));
    }
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, v),
        ValueKind::String => write_str(out, v.as_str().unwrap_or(""), opts.ensure_ascii),
        ValueKind::Map => {
            let mut pairs: Vec<(Value, Value)> = Vec::new();
            for k in v.try_iter()? {
                let item = v.get_item(&k)?;
                pairs.push((k, item));
            }
            if opts.sort_keys {
                pairs.sort_by_key(|p| p.0.to_string());
            }
            if pairs.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (k, item)) in pairs.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, depth + 1);
                let key = match k.kind() {
                    ValueKind::String => k.as_str().unwrap_or("").to_string(),
                    ValueKind::None | ValueKind::Undefined => "null".into(),
                    ValueKind::Bool => (if k.is_true() { "true" } else { "false" }).into(),
                    _ => {
                        let mut s = String::new();
                        write_number(&mut s, k);
                        s
                    }
                };
                write_str(out, &key, opts.ensure_ascii);
                out.push_str(&opts.key_sep);
                write_value(out, item, opts, depth + 1)?;
            }
            newline(out, opts, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, depth + 1);
                write_value(out, item, opts, depth + 1)?;
            }
            newline(out, opts, depth);
            out.push(']');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a {} value", v.kind()),
            ))
        }
    }
    Ok(())
}

fn write_number(out: &mut String, v: &Value) {
    if v.is_integer() {
        let _ = write!(out, "{v}");
        return;
    }
    match f64::try_from(v.clone()) {
        Ok(f) => out.push_str(&py_float_repr(f)),
        Err(_) => {
            let _ = write!(out, "{v}");
        }
    }
}

/// Python's `repr(float)`: shortest round-trip digits; scientific below 1e-4 and from 1e16.
pub(crate) fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    if f == 0.0 {
        return if f.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    let sci = format!("{f:e}"); // e.g. "1.5e-7", "-1e20"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = format!("{f}");
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

fn write_str(out: &mut String, s: &str, ensure_ascii: bool) {
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
            c if ensure_ascii && (c as u32) > 0x7E => {
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

/// Output formatter: Python `str()` for floats, sequences and maps; minijinja's default otherwise.
pub(crate) fn py_formatter(out: &mut Output, state: &State, value: &Value) -> Result<(), Error> {
    let text = match value.kind() {
        ValueKind::Number if !value.is_integer() => {
            let mut s = String::new();
            write_number(&mut s, value);
            s
        }
        ValueKind::Seq | ValueKind::Map => {
            let mut s = String::new();
            write_repr(&mut s, value, 0)?;
            s
        }
        _ => return minijinja::escape_formatter(out, state, value),
    };
    out.write_str(&text)
        .map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string()))
}

/// Python `repr()` of a value inside a container.
fn write_repr(out: &mut String, v: &Value, depth: usize) -> Result<(), Error> {
    if depth > MAX_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "value nested too deeply to print",
        ));
    }
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number => write_number(out, v),
        ValueKind::String => write_py_str(out, v.as_str().unwrap_or("")),
        ValueKind::Map => {
            out.push('{');
            for (i, k) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                let item = v.get_item(&k)?;
                write_repr(out, &k, depth + 1)?;
                out.push_str(": ");
                write_repr(out, &item, depth + 1)?;
            }
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &item, depth + 1)?;
            }
            out.push(']');
        }
        _ => {
            let _ = write!(out, "{v}");
        }
    }
    Ok(())
}

/// Python `repr(str)`: single quotes unless the text has ' and no ", escapes for non-printables.
fn write_py_str(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
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
            c if !py_printable(c) => {
                let cp = c as u32;
                let _ = match cp {
                    0..=0xFF => write!(out, "\\x{cp:02x}"),
                    0x100..=0xFFFF => write!(out, "\\u{cp:04x}"),
                    _ => write!(out, "\\U{cp:08x}"),
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `str.isprintable` for one char: not a control/format/unassigned char, not a
/// separator other than the ASCII space.
fn py_printable(c: char) -> bool {
    c == ' ' || !matches!(category(c as u32), Category::Control | Category::Separator)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python() {
        assert_eq!(py_float_repr(1.0), "1.0");
        assert_eq!(py_float_repr(0.1), "0.1");
        assert_eq!(py_float_repr(1e16), "1e+16");
        assert_eq!(py_float_repr(123456789012345.6), "123456789012345.6");
        assert_eq!(py_float_repr(1.5e-7), "1.5e-07");
        assert_eq!(py_float_repr(0.0001), "0.0001");
    }

    #[test]
    fn dumps_matches_python_defaults() {
        let v =
            Value::from_serialize(serde_json::json!({"b": [1, 2.5, null, true], "a": "é\n\"<>&"}));
        assert_eq!(
            dumps(&v).unwrap(),
            r#"{"b": [1, 2.5, null, true], "a": "é\n\"<>&"}"#
        );
    }
}
