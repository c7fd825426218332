//! The audit log: append-only JSON lines, one per event (a key made or revoked, an admin
//! action and its outcome, refused authentications, the tenants' limits at start). Each
//! entry carries its sequence number, the previous entry's hash (`prev`) and its own
//! (`hash`, SHA-256 of the entry's canonical JSON without it), so [`verify`] finds any
//! edit, deletion or reordering and names the first entry that does not hold.
//!
//! Writers (the gateway, `tessera keys`) append under the file's lock, reading the last
//! entry to chain onto, so several processes keep one chain. Past `max_bytes` the file is
//! rotated to `<file>.1` (older ones shift up, the oldest beyond `keep` is dropped) and the
//! new file opens with an `audit_rotated` entry chained to the last one of the old file.
//! What the chain cannot show is entries cut off the end of the newest file: compare the
//! last `seq` with what was expected (the logs say each entry's seq) to see that.

use crate::files;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// `prev` of the first entry of a log.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";
/// The event that opens a rotated file.
pub const ROTATED: &str = "audit_rotated";

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("audit log {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("audit log {path}: its last entry cannot be chained onto ({why}); run `tessera audit verify {path}`")]
    Damaged { path: String, why: String },
    #[error("audit log {path}: {source}")]
    AtRest { path: String, source: crate::at_rest::AtRestError },
}

/// An append-only, hash-chained log file.
#[derive(Debug, Clone)]
pub struct AuditLog {
    path: PathBuf,
    max_bytes: u64,
    keep: usize,
}

impl AuditLog {
    /// A log at `path`, rotated past 64 MiB, keeping 8 rotated files.
    pub fn new(path: impl Into<PathBuf>) -> AuditLog {
        AuditLog { path: path.into(), max_bytes: 64 << 20, keep: 8 }
    }

    pub fn with_rotation(mut self, max_bytes: u64, keep: usize) -> AuditLog {
        self.max_bytes = max_bytes.max(1);
        self.keep = keep.max(1);
        self
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one entry: `event` done by `who` (a key id, or a process), with `details`
    /// (an object; anything else is put under `"details"`). Returns the entry's seq.
    pub fn append(&self, event: &str, who: &str, details: Value) -> Result<u64, AuditError> {
        let io = |source| AuditError::Io { path: self.path.display().to_string(), source };
        files::ensure_dir(self.path.parent().unwrap_or(Path::new(""))).map_err(io)?;
        let _lock = files::lock(&self.path).map_err(io)?;
        let mut last = self.last_entry()?;
        let size = std::fs::metadata(&self.path).map_or(0, |m| m.len());
        if let Some((seq, hash)) = last.clone().filter(|_| size >= self.max_bytes) {
            self.rotate().map_err(io)?;
            let previous = files::sidecar(&self.path, "1");
            let name = previous.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let line = entry(seq + 1, &hash, ROTATED, "tessera", serde_json::json!({ "previous": name }));
            self.write_line(&line.0)?;
            last = Some((seq + 1, line.1));
        }
        let (seq, prev) = match last {
            Some((seq, hash)) => (seq + 1, hash),
            None => (0, GENESIS.to_owned()),
        };
        let (line, _) = entry(seq, &prev, event, who, details);
        self.write_line(&line)?;
        Ok(seq)
    }

    /// Appends `line`, sealed when an at-rest key is set.
    fn write_line(&self, line: &str) -> Result<(), AuditError> {
        let path = || self.path.display().to_string();
        let line =
            crate::at_rest::seal_line(line.to_owned()).map_err(|source| AuditError::AtRest { path: path(), source })?;
        let io = |source| AuditError::Io { path: path(), source };
        let mut file = files::append_private(&self.path).map_err(io)?;
        file.write_all(format!("{line}\n").as_bytes()).map_err(io)?;
        file.sync_data().map_err(io)
    }

    /// Shifts `<path>.k` to `<path>.k+1` (dropping the one past `keep`) and `<path>` to
    /// `<path>.1`.
    fn rotate(&self) -> std::io::Result<()> {
        let numbered = |k: usize| files::sidecar(&self.path, &k.to_string());
        match std::fs::remove_file(numbered(self.keep)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        for k in (1..self.keep).rev() {
            if numbered(k).exists() {
                std::fs::rename(numbered(k), numbered(k + 1))?;
            }
        }
        std::fs::rename(&self.path, numbered(1))
    }

    /// The seq and hash of the file's last entry, `None` for an empty or missing file.
    fn last_entry(&self) -> Result<Option<(u64, String)>, AuditError> {
        let damaged = |why: String| AuditError::Damaged { path: self.path.display().to_string(), why };
        let io = |source| AuditError::Io { path: self.path.display().to_string(), source };
        let mut file = match std::fs::File::open(&self.path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(e)),
        };
        let len = file.metadata().map_err(io)?.len();
        if len == 0 {
            return Ok(None);
        }
        // Entries are small: the last one is within the tail, unless the file is damaged.
        let start = len.saturating_sub(1 << 16);
        file.seek(SeekFrom::Start(start)).map_err(io)?;
        let mut tail = Vec::new();
        file.read_to_end(&mut tail).map_err(io)?;
        let Some(body) = tail.strip_suffix(b"\n") else {
            return Err(damaged("it does not end with a whole line".into()));
        };
        let line = match body.iter().rposition(|&b| b == b'\n') {
            Some(at) => &body[at + 1..],
            None if start == 0 => body,
            None => return Err(damaged("its last line is over 64 KiB".into())),
        };
        let line = crate::at_rest::open_line(line, &format!("the last entry of audit log {}", self.path.display()))
            .map_err(|source| AuditError::AtRest { path: self.path.display().to_string(), source })?;
        let checked = check_line(&line).map_err(damaged)?;
        Ok(Some((checked.seq, checked.hash)))
    }
}

/// The line of an entry and its hash.
fn entry(seq: u64, prev: &str, event: &str, who: &str, details: Value) -> (String, String) {
    let mut fields = match details {
        Value::Object(map) => map,
        Value::Null => Map::new(),
        other => Map::from_iter([("details".to_owned(), other)]),
    };
    let unix_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    fields.insert("seq".into(), seq.into());
    fields.insert("unix_ms".into(), (unix_ms as u64).into());
    fields.insert("prev".into(), prev.into());
    fields.insert("event".into(), event.into());
    fields.insert("who".into(), who.into());
    fields.remove("hash");
    let hash = crate::hex(&Sha256::digest(canonical(&Value::Object(fields.clone())).as_bytes()));
    fields.insert("hash".into(), hash.clone().into());
    (canonical(&Value::Object(fields)), hash)
}

/// JSON with every object's keys sorted, at every depth: what an entry's hash covers,
/// the same however a JSON library orders keys.
fn canonical(value: &Value) -> String {
    fn sorted(value: &Value) -> Value {
        match value {
            Value::Object(map) => {
                let by_key: BTreeMap<&String, Value> = map.iter().map(|(k, v)| (k, sorted(v))).collect();
                Value::Object(by_key.into_iter().map(|(k, v)| (k.clone(), v)).collect())
            }
            Value::Array(items) => Value::Array(items.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }
    // Serializing a `Value` cannot fail.
    serde_json::to_string(&sorted(value)).unwrap_or_default()
}

/// What one line says of itself, once its own hash holds.
struct Checked {
    seq: u64,
    prev: String,
    hash: String,
    event: String,
}

fn check_line(line: &[u8]) -> Result<Checked, String> {
    let value: Value = serde_json::from_slice(line).map_err(|e| format!("not a JSON entry ({e})"))?;
    let Value::Object(mut fields) = value else { return Err("not a JSON object".into()) };
    let text = |fields: &Map<String, Value>, key: &str| {
        fields.get(key).and_then(Value::as_str).map(str::to_owned).ok_or_else(|| format!("no `{key}`"))
    };
    let hash = text(&fields, "hash")?;
    fields.remove("hash");
    let seq = fields.get("seq").and_then(Value::as_u64).ok_or("no `seq`")?;
    let prev = text(&fields, "prev")?;
    let event = text(&fields, "event")?;
    let object = Value::Object(fields);
    if crate::hex(&Sha256::digest(canonical(&object).as_bytes())) != hash {
        return Err(format!("entry seq {seq} does not match its hash: it was edited"));
    }
    Ok(Checked { seq, prev, hash, event })
}

/// An intact chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    pub entries: u64,
    pub first_seq: u64,
    pub last_seq: u64,
    /// The chain starts at the log's first entry (seq 0), not at a rotation whose
    /// older file was not given.
    pub from_genesis: bool,
}

/// The first entry that does not hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}: {why}")]
pub struct VerifyError {
    pub file: String,
    /// 1-based; 0 when the file itself could not be read.
    pub line: usize,
    pub why: String,
}

/// Checks the chain through `files`, oldest first (`audit.log.2 audit.log.1 audit.log`).
pub fn verify(files: &[PathBuf]) -> Result<VerifyReport, VerifyError> {
    let mut last: Option<(u64, String)> = None;
    let mut report = VerifyReport { entries: 0, first_seq: 0, last_seq: 0, from_genesis: false };
    for path in files {
        let file = path.display().to_string();
        let text = std::fs::read(path).map_err(|e| VerifyError { file: file.clone(), line: 0, why: e.to_string() })?;
        if text.is_empty() {
            return Err(VerifyError { file, line: 0, why: "the file is empty".into() });
        }
        let Some(body) = text.strip_suffix(b"\n") else {
            let line = text.iter().filter(|&&b| b == b'\n').count() + 1;
            return Err(VerifyError { file, line, why: "the last line is cut off (no newline)".into() });
        };
        for (i, line) in body.split(|&b| b == b'\n').enumerate() {
            let bad = |why: String| VerifyError { file: file.clone(), line: i + 1, why };
            let line = crate::at_rest::open_line(line, "the entry").map_err(|e| bad(e.to_string()))?;
            let entry = check_line(&line).map_err(bad)?;
            match &last {
                None if entry.seq == 0 => {
                    if entry.prev != GENESIS {
                        return Err(bad("the first entry (seq 0) does not start the chain".into()));
                    }
                    report.from_genesis = true;
                    report.first_seq = 0;
                }
                None if entry.event == ROTATED => report.first_seq = entry.seq,
                None => {
                    return Err(bad(format!(
                        "the first entry has seq {} but neither starts the log (seq 0) nor follows a rotation: the entries before it were removed",
                        entry.seq
                    )));
                }
                Some((seq, hash)) => {
                    if entry.seq != seq + 1 {
                        return Err(bad(format!(
                            "entry seq {} follows seq {seq}: entries were {}",
                            entry.seq,
                            if entry.seq > seq + 1 { "removed" } else { "reordered or repeated" }
                        )));
                    }
                    if &entry.prev != hash {
                        return Err(bad(format!(
                            "entry seq {} does not chain onto seq {seq}: the entry before it was replaced",
                            entry.seq
                        )));
                    }
                }
            }
            report.entries += 1;
            report.last_seq = entry.seq;
            last = Some((entry.seq, entry.hash));
        }
    }
    if last.is_none() {
        return Err(VerifyError { file: String::new(), line: 0, why: "no files given".into() });
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn lines(path: &Path) -> Vec<String> {
        std::fs::read_to_string(path).unwrap().lines().map(str::to_owned).collect()
    }

    fn write_lines(path: &Path, lines: &[String]) {
        std::fs::write(path, lines.iter().map(|l| format!("{l}\n")).collect::<String>()).unwrap();
    }

    fn log_of(n: usize) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let log = AuditLog::new(&path);
        for i in 0..n {
            log.append("admin_action", "key1", json!({"route": format!("/admin/{i}"), "status": 200})).unwrap();
        }
        (dir, path)
    }

    #[test]
    fn an_intact_log_verifies_and_every_tampering_names_the_first_bad_entry() {
        let (_dir, path) = log_of(5);
        let report = verify(std::slice::from_ref(&path)).unwrap();
        assert_eq!(report, VerifyReport { entries: 5, first_seq: 0, last_seq: 4, from_genesis: true });
        let original = lines(&path);
        // (what is done to the lines, the line named, words in the reason)
        let edit = |mut l: Vec<String>| {
            l[2] = l[2].replace("/admin/2", "/admin/x");
            l
        };
        let edit_rehashed = |mut l: Vec<String>| {
            let (line, _) = entry(2, "f".repeat(64).as_str(), "admin_action", "key1", json!({}));
            l[2] = line;
            l
        };
        let delete = |mut l: Vec<String>| {
            l.remove(2);
            l
        };
        let delete_first = |mut l: Vec<String>| {
            l.remove(0);
            l
        };
        let reorder = |mut l: Vec<String>| {
            l.swap(1, 3);
            l
        };
        type Tamper = fn(Vec<String>) -> Vec<String>;
        let table: [(&str, Tamper, usize, &str); 5] = [
            ("edit", edit, 3, "edited"),
            ("edit with a new hash", edit_rehashed, 3, "does not chain onto seq 1"),
            ("delete", delete, 3, "removed"),
            ("delete the first", delete_first, 1, "removed"),
            ("reorder", reorder, 2, "seq 3 follows seq 0"),
        ];
        for (what, tamper, line, words) in table {
            write_lines(&path, &tamper(original.clone()));
            let err = verify(std::slice::from_ref(&path)).unwrap_err();
            assert_eq!(err.line, line, "{what}: {err}");
            assert!(err.why.contains(words), "{what}: {err}");
        }
        // Appending after a damage is refused rather than chaining onto it.
        std::fs::write(&path, format!("{}\n{{\"half", original[0])).unwrap();
        let err = AuditLog::new(&path).append("x", "y", Value::Null).unwrap_err();
        assert!(err.to_string().contains("whole line"), "{err}");
    }

    #[test]
    fn rotation_keeps_the_chain_across_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let log = AuditLog::new(&path).with_rotation(600, 3);
        for i in 0..20 {
            log.append("key_created", "cli", json!({"key": i})).unwrap();
        }
        let mut files: Vec<PathBuf> = (1..=3).rev().map(|k| files::sidecar(&path, &k.to_string())).collect();
        files.retain(|f| f.exists());
        assert!(files.len() >= 2, "rotated");
        files.push(path.clone());
        let report = verify(&files).unwrap();
        assert!(!report.from_genesis, "the oldest files were dropped");
        let last: Value = serde_json::from_str(lines(&path).last().unwrap()).unwrap();
        assert_eq!(report.last_seq, last["seq"].as_u64().unwrap());
        // The newest file alone verifies from its rotation entry.
        assert!(verify(std::slice::from_ref(&path)).is_ok());
        // Files out of order do not.
        files.swap(0, 1);
        assert!(verify(&files).is_err());
    }

    #[test]
    fn two_writers_keep_one_chain() {
        let (_dir, path) = log_of(0);
        std::thread::scope(|s| {
            for w in 0..4 {
                let log = AuditLog::new(&path);
                s.spawn(move || {
                    for i in 0..25 {
                        log.append("admin_action", &format!("writer{w}"), json!({ "i": i })).unwrap();
                    }
                });
            }
        });
        assert_eq!(verify(&[path]).unwrap().entries, 100);
    }
}
