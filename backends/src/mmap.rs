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

/// Where weights used as stored live on a device that shares host memory
/// (`TESSERA_MAP_WEIGHTS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// In the file's mapping where the kernel backs it with huge pages, else copied into
    /// the device's own buffers (the default).
    Auto,
    /// Always in the file's mapping: no copy, the least memory.
    Map,
    /// Always copied into the device's buffers.
    Copy,
}

impl Placement {
    /// `TESSERA_MAP_WEIGHTS`: `auto` (or unset), `yes` or `no`.
    pub fn from_env() -> Result<Placement> {
        match std::env::var("TESSERA_MAP_WEIGHTS") {
            Err(_) => Ok(Placement::Auto),
            Ok(v) => Placement::parse(&v),
        }
    }

    fn parse(value: &str) -> Result<Placement> {
        match value {
            "auto" | "" => Ok(Placement::Auto),
            "yes" => Ok(Placement::Map),
            "no" => Ok(Placement::Copy),
            _ => Err(BackendError::WeightPlacement { value: value.to_owned() }),
        }
    }

    /// Whether weights used as stored stay in their file's map, given `eligible`, the
    /// map's [`huge_page_eligible`] (asked only under `Auto`). Copies go to the
    /// device's buffers, which the CPU device backs with 2 MiB pages: a mapping of
    /// 4 KiB pages costs a page walk every 4 KiB of a decode step's stream of weights
    /// (on a Zen 4 whose ext4 gave the file 4 KiB pages, batch-1 decode steps of the
    /// bench model took 0.90-0.96 of the mapped weights' time copied, 11 runs of each
    /// in turns).
    pub fn keeps(self, eligible: impl FnOnce() -> Option<bool>) -> bool {
        match self {
            Placement::Map => true,
            Placement::Copy => false,
            // Where it cannot be told, as before: no copy.
            Placement::Auto => eligible().unwrap_or(true),
        }
    }
}

/// Whether the kernel may back the mapping holding `bytes` with huge pages: its
/// `THPeligible` field in /proc/self/smaps. None where that cannot be read.
pub fn huge_page_eligible(bytes: &[u8]) -> Option<bool> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    thp_eligible_in(&smaps, bytes.as_ptr() as usize)
}

/// The `THPeligible` field of the mapping of `smaps` (the text of /proc/PID/smaps)
/// that contains `addr`.
fn thp_eligible_in(smaps: &str, addr: usize) -> Option<bool> {
    let mut inside = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        // A mapping's header starts with its address range, `start-end` in hex.
        if let Some((a, b)) = first.split_once('-')
            && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
        {
            inside = (a..b).contains(&addr);
        } else if inside && let Some(v) = line.strip_prefix("THPeligible:") {
            return Some(v.trim() == "1");
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55d0c0000000-55d0c0021000 r--p 00000000 fe:00 1234    /usr/bin/tessera
Rss:                 132 kB
THPeligible:           0
7f9fd4c00000-7fa0424eb000 r--s 00000000 fe:00 5375470  /work/bench-f16.gguf
Rss:              148836 kB
FilePmdMapped:         0 kB
THPeligible:           1
7fa0424eb000-7fa0424ec000 rw-p 00000000 00:00 0
THPeligible:           0
";

    #[test]
    fn the_mapping_holding_an_address_says_whether_huge_pages_may_back_it() {
        assert_eq!(thp_eligible_in(SMAPS, 0x7f9f_d4c0_0000), Some(true));
        assert_eq!(thp_eligible_in(SMAPS, 0x7fa0_424e_afff), Some(true));
        assert_eq!(thp_eligible_in(SMAPS, 0x7fa0_424e_b000), Some(false), "the next mapping");
        assert_eq!(thp_eligible_in(SMAPS, 0x55d0_c000_0010), Some(false));
        assert_eq!(thp_eligible_in(SMAPS, 0x1000), None, "in no mapping");
    }

    #[test]
    fn placement_names_are_auto_yes_no() {
        assert_eq!(Placement::parse("auto").unwrap(), Placement::Auto);
        assert_eq!(Placement::parse("yes").unwrap(), Placement::Map);
        assert_eq!(Placement::parse("no").unwrap(), Placement::Copy);
        let e = Placement::parse("sometimes").unwrap_err().to_string();
        assert_eq!(e, "TESSERA_MAP_WEIGHTS=\"sometimes\" is none of auto, yes, no");
        let asked = |answer| move || -> Option<bool> { answer };
        assert!(Placement::Map.keeps(asked(Some(false))) && !Placement::Copy.keeps(asked(Some(true))));
        assert!(Placement::Auto.keeps(asked(Some(true))) && !Placement::Auto.keeps(asked(Some(false))));
        assert!(Placement::Auto.keeps(asked(None)), "where it cannot be told, the map");
    }

    /// This process's own mapping of a file answers (on Linux, where /proc is).
    #[test]
    fn a_file_mapping_of_this_process_is_found() {
        if !Path::new("/proc/self/smaps").exists() {
            eprintln!("skipped: no /proc/self/smaps");
            return;
        }
        let path = std::env::temp_dir().join(format!("tessera-smaps-{}", std::process::id()));
        std::fs::write(&path, vec![7u8; 1 << 16]).unwrap();
        let map = map_file(&path).unwrap();
        let eligible = huge_page_eligible(&map[..]);
        std::fs::remove_file(&path).unwrap();
        assert!(eligible.is_some(), "the map at {:p} is in /proc/self/smaps", map.as_ptr());
    }
}
