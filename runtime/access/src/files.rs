//! Private files: written whole (a reader sees the old file or the new one, never half),
//! readable by the owner only, and changed by one process at a time.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Owner read and write only.
pub const PRIVATE_MODE: u32 = 0o600;

/// An exclusive lock on `path`'s sidecar `<path>.lock` (not on the file itself, which a
/// writer replaces by renaming), released when dropped.
pub struct FileLock {
    _file: File,
}

pub fn lock(path: &Path) -> std::io::Result<FileLock> {
    let file =
        OpenOptions::new().create(true).truncate(false).write(true).mode(PRIVATE_MODE).open(sidecar(path, "lock"))?;
    file.lock()?;
    Ok(FileLock { _file: file })
}

/// Replaces `path` with `bytes`: written to a private temporary file beside it, synced,
/// then renamed over it.
pub fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = sidecar(path, &format!("tmp-{}", std::process::id()));
    let result = (|| {
        let mut file = OpenOptions::new().create(true).truncate(true).write(true).mode(PRIVATE_MODE).open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Opens `path` for appending, creating it private.
pub fn append_private(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().create(true).append(true).mode(PRIVATE_MODE).open(path)
}

/// `<path>.<suffix>`.
pub fn sidecar(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".");
    name.push(suffix);
    PathBuf::from(name)
}

/// Makes `dir` (and its parents) if missing.
pub fn ensure_dir(dir: &Path) -> std::io::Result<()> {
    if dir.as_os_str().is_empty() { Ok(()) } else { std::fs::create_dir_all(dir) }
}
