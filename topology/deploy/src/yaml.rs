//! A YAML writer for JSON values, enough for manifests: block mappings and sequences,
//! strings double-quoted with JSON escapes (valid YAML), keys plain where YAML reads them
//! back as the same string.

use serde_json::Value;
use std::fmt::Write;

/// `value` as one YAML document.
pub fn document(value: &Value) -> String {
    let mut out = String::new();
    block(&mut out, value, 0);
    out
}

fn scalar(value: &Value) -> String {
    match value {
        Value::String(s) => Value::String(s.clone()).to_string(),
        other => other.to_string(),
    }
}

fn key(k: &str) -> String {
    let plain = !k.is_empty()
        && k.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '/' | '-' | '_'))
        && k.starts_with(|c: char| c.is_ascii_alphabetic());
    if plain { k.to_owned() } else { Value::String(k.to_owned()).to_string() }
}

fn is_empty_collection(v: &Value) -> bool {
    matches!(v, Value::Object(m) if m.is_empty()) || matches!(v, Value::Array(a) if a.is_empty())
}

/// Writes a mapping or sequence at `indent`, one entry per line.
fn block(out: &mut String, value: &Value, indent: usize) {
    let pad = " ".repeat(indent);
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                match v {
                    Value::Object(_) | Value::Array(_) if !is_empty_collection(v) => {
                        let _ = writeln!(out, "{pad}{}:", key(k));
                        block(out, v, if v.is_array() { indent } else { indent + 2 });
                    }
                    Value::Object(_) => {
                        let _ = writeln!(out, "{pad}{}: {{}}", key(k));
                    }
                    Value::Array(_) => {
                        let _ = writeln!(out, "{pad}{}: []", key(k));
                    }
                    _ => {
                        let _ = writeln!(out, "{pad}{}: {}", key(k), scalar(v));
                    }
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                match item {
                    Value::Object(_) | Value::Array(_) if !is_empty_collection(item) => {
                        // "- " then the first line of the item's block on the same line.
                        let mut inner = String::new();
                        block(&mut inner, item, indent + 2);
                        let trimmed = inner.trim_start_matches(' ');
                        let _ = write!(out, "{pad}- {trimmed}");
                    }
                    _ => {
                        let _ = writeln!(out, "{pad}- {}", scalar(item));
                    }
                }
            }
        }
        other => {
            let _ = writeln!(out, "{pad}{}", scalar(other));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nested_mappings_and_sequences_read_as_yaml_blocks() {
        let v =
            json!({"a": 1, "b": {"c": "x: y", "d": [1, {"e": true, "f": []}]}, "g": {}, "app.kubernetes.io/name": "t"});
        assert_eq!(
            document(&v),
            "a: 1\nb:\n  c: \"x: y\"\n  d:\n  - 1\n  - e: true\n    f: []\ng: {}\napp.kubernetes.io/name: \"t\"\n"
        );
    }
}
