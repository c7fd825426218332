//! Read-only memory maps of checkpoint files: the one place outside the loader that
//! needs `unsafe`.

use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{BackendError, Result};

/// Maps `path` read-only.
pub fn map_file(path: &Path) -> Result<Arc<Mmap>> {
    let file = std::fs::File::open(path).map_err(|e| BackendError::io(path, e))?;
    // SAFETY: the map is read-only and private to this process. Checkpoints are not
    // modified while served; if one were truncated underneath us the process would
    // fault, which is the documented contract of serving from a memory map (as every
    // mmap-based loader does).
    let map = unsafe { Mmap::map(&file) }.map_err(|e| BackendError::io(path, e))?;
    Ok(Arc::new(map))
}
