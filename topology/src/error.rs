//! The error of this crate — what is wrong with a topology file, and where — and how
//! byte offsets in a topology file become the line, column and dotted key an operator
//! can find.

use std::collections::HashMap;
use std::ops::Range;

/// What is wrong with a topology file, and where.
///
/// `line` and `column` are 1-based (the column counts characters, not bytes). An error
/// that is about the file as a whole (it could not be read) has `line == 0`,
/// `column == 0` and an empty `key`, and displays as `{file}: {message}`; every other
/// error displays as `{file}:{line}:{column}: `{key}`: {message}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe())]
pub struct TopologyError {
    pub file: String,
    pub line: usize,
    pub column: usize,
    /// Dotted path of the offending key, e.g. `hosts[1].chips[0].id`.
    pub key: String,
    pub message: String,
}

impl TopologyError {
    /// An error about the whole file (it could not be read). Public, like [`Self::at`]
    /// and [`Self::from_toml`], so that files which embed or point at a topology (the
    /// simulator's scenarios) report their own errors in the same form.
    pub fn file(file: &str, message: String) -> Self {
        TopologyError { file: file.to_owned(), line: 0, column: 0, key: String::new(), message }
    }

    /// An error at byte offset `span.start` of `text`.
    pub fn at(file: &str, text: &str, span: Range<usize>, key: String, message: String) -> Self {
        let (line, column) = line_column(text, span.start);
        TopologyError { file: file.to_owned(), line, column, key, message }
    }

    /// A TOML parser or serde error in `text` (syntax, unknown key, wrong type, missing
    /// key), with the dotted key recovered from the table headers.
    pub fn from_toml(file: &str, text: &str, error: &toml::de::Error) -> Self {
        from_toml(file, text, error)
    }

    fn describe(&self) -> String {
        if self.line == 0 {
            format!("{}: {}", self.file, self.message)
        } else if self.key.is_empty() {
            format!("{}:{}:{}: {}", self.file, self.line, self.column, self.message)
        } else {
            format!("{}:{}:{}: `{}`: {}", self.file, self.line, self.column, self.key, self.message)
        }
    }
}

/// 1-based line and character column of byte `offset` in `text`.
pub(crate) fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let offset = floor_char_boundary(text, offset);
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    (line, before[line_start..].chars().count() + 1)
}

fn floor_char_boundary(text: &str, offset: usize) -> usize {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    offset
}

/// Turns an error of the TOML parser or of serde (syntax, unknown key, wrong type,
/// missing key) into a [`TopologyError`]. The parser gives only a byte span, so the
/// dotted key is recovered from the table headers above it (see [`key_at`]).
pub(crate) fn from_toml(file: &str, text: &str, error: &toml::de::Error) -> TopologyError {
    let span = error.span().unwrap_or(0..0);
    let mut key = key_at(text, span.start);
    let message = error.message().trim().to_owned();
    // A missing key is reported at its table's header: name the key itself.
    if let Some(missing) = message.strip_prefix("missing field `").and_then(|rest| rest.split('`').next()) {
        key = join(&key, missing);
    }
    TopologyError::at(file, text, span, key, message)
}

/// The dotted key at byte `offset`: the table in effect there (`hosts[1].chips[0]`,
/// counting `[[array]]` headers), then the key of the `key = value` line the offset is
/// on. This reads lines, not the TOML grammar, so it is exact for the one-key-per-line
/// style of topology files and names the enclosing table otherwise; it also works on
/// text that does not parse, which is when it is needed most.
pub(crate) fn key_at(text: &str, offset: usize) -> String {
    let offset = floor_char_boundary(text, offset);
    let line_start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let mut table = String::new();
    let mut arrays: HashMap<String, usize> = HashMap::new();
    for line in text[..line_start].lines() {
        if let Some(header) = Header::parse(line) {
            table = header.resolve(&mut arrays);
        }
    }
    let line = text[line_start..].lines().next().unwrap_or("");
    if let Some(header) = Header::parse(line) {
        return header.resolve(&mut arrays);
    }
    let trimmed = line.trim_start();
    if trimmed.starts_with('#') {
        return table;
    }
    match trimmed.split_once('=') {
        Some((key, _)) if !key.trim().is_empty() => {
            let key: Vec<String> = key.split('.').map(unquote).collect();
            join(&table, &key.join("."))
        }
        _ => table,
    }
}

fn join(table: &str, key: &str) -> String {
    if table.is_empty() { key.to_owned() } else { format!("{table}.{key}") }
}

fn unquote(segment: &str) -> String {
    segment.trim().trim_matches(|c| c == '"' || c == '\'').to_owned()
}

/// A `[table]` or `[[array.of.tables]]` header line.
struct Header {
    segments: Vec<String>,
    array: bool,
}

impl Header {
    fn parse(line: &str) -> Option<Header> {
        let line = line.trim();
        let (inner, array) = if let Some(rest) = line.strip_prefix("[[") {
            (rest.split_once("]]")?.0, true)
        } else if let Some(rest) = line.strip_prefix('[') {
            (rest.split_once(']')?.0, false)
        } else {
            return None;
        };
        Some(Header { segments: inner.split('.').map(unquote).collect(), array })
    }

    /// The header's dotted path with array indices; an `[[array]]` header opens a new
    /// element, so it bumps that array's count.
    fn resolve(&self, arrays: &mut HashMap<String, usize>) -> String {
        let mut path = String::new();
        let last = self.segments.len().saturating_sub(1);
        for (i, segment) in self.segments.iter().enumerate() {
            path = join(&path, segment);
            if i == last && self.array {
                let count = arrays.entry(path.clone()).or_insert(0);
                *count += 1;
                path = format!("{path}[{}]", *count - 1);
            } else if let Some(count) = arrays.get(&path) {
                path = format!("{path}[{}]", count.saturating_sub(1));
            }
        }
        path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_column_is_one_based_and_counts_characters() {
        let text = "a = 1\nb = \"é\" x\n";
        assert_eq!(line_column(text, 0), (1, 1));
        assert_eq!(line_column(text, 6), (2, 1));
        let x = text.find('x').unwrap_or(0);
        assert_eq!(line_column(text, x), (2, 9));
    }

    #[test]
    fn key_at_counts_array_headers() {
        let text = "[cluster]\nmodel = 1\n[[hosts]]\nname = 1\n[[hosts.chips]]\nid = 1\n\
                    [[hosts]]\nname = 2\n[[hosts.chips]]\nid = 2\n[[hosts.chips]]\n  kind = 3\n";
        let at = |needle: &str| key_at(text, text.find(needle).unwrap_or(usize::MAX));
        assert_eq!(at("model"), "cluster.model");
        assert_eq!(at("name = 2"), "hosts[1].name");
        assert_eq!(at("id = 2"), "hosts[1].chips[0].id");
        assert_eq!(at("kind"), "hosts[1].chips[1].kind");
        assert_eq!(at("[[hosts]]\nname = 2"), "hosts[1]");
    }

    #[test]
    fn display_names_file_line_column_and_key() {
        let error = TopologyError::at("t.toml", "a\nbc", 3..4, "x.y".into(), "bad".into());
        assert_eq!(error.to_string(), "t.toml:2:2: `x.y`: bad");
        assert_eq!(TopologyError::file("t.toml", "cannot read".into()).to_string(), "t.toml: cannot read");
    }
}
