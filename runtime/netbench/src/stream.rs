//! The STREAM "Copy" kernel (McCalpin): `a[i] = b[i]` over `f64` arrays far larger than
//! the caches, best of several passes. `bench transfer` prints it beside its copies as
//! the machine's memory-bandwidth ceiling.
//!
//! The loop runs as one `memcpy` per 64 KiB piece: small enough that `memcpy` keeps
//! ordinary, cache-allocating stores (as STREAM's compiled loop does; a whole-array
//! `memcpy` switches to non-temporal stores, which skip the read-for-ownership and so
//! beat the kernel), and as fast at the dev profile's optimisation level as in release.
//!
//! Figures are bytes *copied* per second, the unit of every other row of the bench;
//! STREAM itself counts bytes read + written, twice that.

use std::time::Instant;

/// Elements per `memcpy`: 64 KiB, below any `memcpy`'s non-temporal threshold.
const PIECE: usize = (64 << 10) / 8;

/// Bounds of the default array size (each of the two arrays).
const MIN_ARRAY_BYTES: usize = 256 << 20;
const MAX_ARRAY_BYTES: usize = 1 << 30;

/// The figures, as `bench transfer` reports them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StreamCopy {
    /// Bytes of each array (source and destination).
    pub array_bytes: usize,
    pub passes: usize,
    /// One thread: the ceiling of a copy made by one thread (engine shm, memcpy).
    pub one_thread_gb_per_s: f64,
    pub threads: usize,
    /// `threads` threads, one slice of the arrays each: the machine's ceiling.
    pub all_threads_gb_per_s: f64,
}

/// STREAM's rule: each array at least four times the last-level cache; here clamped to
/// 256 MiB..=1 GiB so the bench stays affordable (256 MiB when the cache size is unknown).
pub fn default_array_bytes() -> usize {
    last_level_cache_bytes()
        .map_or(MIN_ARRAY_BYTES, |llc| llc.saturating_mul(4).clamp(MIN_ARRAY_BYTES, MAX_ARRAY_BYTES))
}

/// The largest cache size Linux lists for CPU 0 (`None` elsewhere or if unreadable).
fn last_level_cache_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|entry| std::fs::read_to_string(entry.ok()?.path().join("size")).ok())
        .filter_map(|size| parse_cache_size(&size))
        .max()
}

/// `32K`, `4096K`, `300M`, `1G` or a plain byte count.
fn parse_cache_size(text: &str) -> Option<usize> {
    let t = text.trim();
    let (digits, scale) = match t.as_bytes().last()? {
        b'K' => (&t[..t.len() - 1], 1 << 10),
        b'M' => (&t[..t.len() - 1], 1 << 20),
        b'G' => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    digits.parse::<usize>().ok()?.checked_mul(scale)
}

/// Measures the kernel over two arrays of `array_bytes` on one thread, then on `threads`.
pub fn measure(array_bytes: usize, threads: usize, passes: usize) -> StreamCopy {
    let threads = threads.max(1);
    let passes = passes.max(1);
    let n = (array_bytes / 8).max(1);
    // Both arrays written before timing: no pass pays a page fault.
    let b = vec![1.0f64; n];
    let mut a = vec![0.0f64; n];
    std::hint::black_box(&mut a).fill(2.0);
    let one = best_of(passes, || copy(&mut a, &b, 1));
    let all = best_of(passes, || copy(&mut a, &b, threads));
    let bytes = (n * 8) as f64;
    StreamCopy {
        array_bytes: n * 8,
        passes,
        one_thread_gb_per_s: bytes / one / 1e9,
        threads,
        all_threads_gb_per_s: bytes / all / 1e9,
    }
}

/// Shortest wall time of `passes` calls, in seconds.
fn best_of(passes: usize, mut pass: impl FnMut()) -> f64 {
    (0..passes)
        .map(|_| {
            let t = Instant::now();
            pass();
            t.elapsed().as_secs_f64().max(1e-9)
        })
        .fold(f64::INFINITY, f64::min)
}

/// `a[i] = b[i]` for every `i`, split over `threads` threads.
fn copy(a: &mut [f64], b: &[f64], threads: usize) {
    let kernel = |a: &mut [f64], b: &[f64]| {
        for (a, b) in a.chunks_mut(PIECE).zip(b.chunks(PIECE)) {
            a.copy_from_slice(b);
        }
    };
    if threads == 1 {
        kernel(a, std::hint::black_box(b));
        return;
    }
    let slice = a.len().div_ceil(threads);
    std::thread::scope(|scope| {
        for (a, b) in a.chunks_mut(slice).zip(b.chunks(slice)) {
            scope.spawn(move || kernel(a, std::hint::black_box(b)));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cache_sizes() {
        assert_eq!(parse_cache_size("32K\n"), Some(32 << 10));
        assert_eq!(parse_cache_size("300M"), Some(300 << 20));
        assert_eq!(parse_cache_size("1G"), Some(1 << 30));
        assert_eq!(parse_cache_size("4096"), Some(4096));
        assert_eq!(parse_cache_size("lots"), None);
        assert_eq!(parse_cache_size(""), None);
    }

    #[test]
    fn default_array_is_within_bounds() {
        assert!((MIN_ARRAY_BYTES..=MAX_ARRAY_BYTES).contains(&default_array_bytes()));
    }

    #[test]
    fn copies_every_element_on_any_thread_count() {
        let n = 3 * PIECE + 5;
        let b: Vec<f64> = (0..n).map(|i| i as f64).collect();
        for threads in [1, 2, 3] {
            let mut a = vec![0.0; n];
            copy(&mut a, &b, threads);
            assert_eq!(a, b, "{threads} threads");
        }
        let figures = measure(1 << 20, 2, 2);
        assert_eq!((figures.array_bytes, figures.threads, figures.passes), (1 << 20, 2, 2));
        assert!(figures.one_thread_gb_per_s > 0.0 && figures.all_threads_gb_per_s > 0.0);
    }
}
