//! Builtin test models: generated with `synth` on first use into a cache directory, so
//! a fresh machine can serve without downloading anything.

use std::path::PathBuf;

use crate::error::{BackendError, Result};
use crate::synth::{Preset, SynthArch, SynthSpec, write_checkpoint};

/// Environment variable naming Tessera's cache directory.
pub const HOME_ENV: &str = "TESSERA_HOME";

/// `$TESSERA_HOME`, else `$XDG_CACHE_HOME/tessera`, else `$HOME/.cache/tessera`, else a
/// folder under the system temp dir.
pub fn cache_dir() -> PathBuf {
    if let Some(p) = std::env::var_os(HOME_ENV) {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(p).join("tessera");
    }
    if let Some(p) = std::env::var_os("HOME") {
        return PathBuf::from(p).join(".cache").join("tessera");
    }
    std::env::temp_dir().join("tessera")
}

/// The directory of builtin model `preset` (llama, seed 0), generating it if missing.
/// Generation goes to a private folder renamed into place, so concurrent first uses
/// never see a half-written checkpoint.
pub fn model_dir(preset: Preset) -> Result<PathBuf> {
    let models = cache_dir().join("models");
    let dir = models.join(format!("{preset}-llama-seed0"));
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    std::fs::create_dir_all(&models).map_err(|e| BackendError::io(&models, e))?;
    let tmp = models.join(format!(".{preset}-{}-{}", std::process::id(), unique()));
    let spec = SynthSpec::new(preset, SynthArch::Llama);
    write_checkpoint(&tmp, &spec)?;
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        // Another process won the race: its copy is identical (generation is deterministic).
        Err(_) if dir.join("config.json").is_file() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(e) => Err(BackendError::io(&dir, e)),
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
