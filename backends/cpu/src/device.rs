//! A CPU "device": a rayon thread pool, a memory budget and the registry of the buffers
//! it owns. Buffer handles are opaque ids that are never dereferenced, so a stale or
//! foreign handle is simply not found in the registry.

use std::alloc::Layout;
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::{KernelError, Result};
use crate::ops::prefill_gemm::Precision;

/// Alignment of every allocation.
pub const ALIGN: usize = 64;
/// Allocations from this size on are mapped on their own, 2 MiB aligned and advised to
/// the kernel as transparent huge pages: the KV cache, weights converted or quantized at
/// load, and the step buffers are streamed whole, and with 4 KiB pages every 4 KiB
/// costs a page walk (an f16 GEMV from DRAM on this round's 2 cores: 40 -> 42 GB/s,
/// medians of 8 runs taken in turns). Weights used as stored are the model file's own
/// mapping where the kernel backs it with huge pages itself, and copied here where it
/// does not (the host's choice: `TESSERA_MAP_WEIGHTS`).
/// The memory limit counts the bytes asked for, not the rounding up to 2 MiB.
#[cfg(target_os = "linux")]
pub const HUGE: usize = 2 << 20;
/// The most threads a device may be configured with.
pub const MAX_THREADS: u32 = 4096;

/// Handle ids are unique over the life of the process (never reused), and start high
/// so that small integers cast to pointers are never valid handles.
static NEXT_HANDLE: AtomicUsize = AtomicUsize::new(0x1000_0000);

/// One live buffer of a device.
#[derive(Debug, Clone, Copy)]
pub struct BufferEntry {
    /// Start address of the memory.
    pub addr: usize,
    /// Size in bytes.
    pub len: usize,
    /// Wrapped caller memory: never written, never freed by us.
    pub read_only: bool,
    /// Bytes of the buffer's own mapping at `addr` (a huge-page allocation), or 0 when
    /// it came from the heap.
    pub mapped: usize,
}

pub struct Device {
    pub pool: rayon::ThreadPool,
    pub threads: usize,
    pub memory_limit: u64,
    /// The arithmetic of prompts' linear layers: `Precision as u8` (0 = F32).
    precision: std::sync::atomic::AtomicU8,
    used: Mutex<u64>,
    buffers: Mutex<HashMap<usize, BufferEntry>>,
}

/// Physical RAM in bytes (from /proc/meminfo), or 16 GiB if it cannot be read.
pub fn physical_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<u64>().ok()))
        })
        .map(|kb| kb * 1024)
        .unwrap_or(16 << 30)
}

fn layout(bytes: usize) -> Result<Layout> {
    Layout::from_size_align(bytes.max(1), ALIGN)
        .map_err(|_| KernelError::OutOfMemory(format!("{bytes} bytes cannot be allocated")))
}

impl Device {
    /// The arithmetic of prompts' linear layers.
    pub fn precision(&self) -> Precision {
        match self.precision.load(std::sync::atomic::Ordering::Relaxed) {
            1 => Precision::Bf16,
            _ => Precision::F32,
        }
    }

    pub fn set_precision(&self, p: Precision) {
        self.precision.store(p as u8, std::sync::atomic::Ordering::Relaxed);
    }

    /// Creates a device with `threads` workers (0 = all cores) and a memory limit
    /// (0 = physical RAM).
    pub fn new(threads: u32, memory_limit: u64) -> Result<Device> {
        if let Err(message) = crate::simd::isa_cap() {
            return Err(crate::invalid!("{message}"));
        }
        if threads > MAX_THREADS {
            return Err(crate::invalid!("config.threads = {threads} exceeds the maximum of {MAX_THREADS}"));
        }
        let threads = if threads == 0 {
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
        } else {
            threads as usize
        };
        let builder =
            || rayon::ThreadPoolBuilder::new().num_threads(threads).thread_name(|i| format!("tessera-cpu-{i}"));
        // The creating thread (a chip's worker) joins the pool, so that its op calls
        // run inline instead of waking a pool thread for every op. A thread can belong
        // to one pool only: a second device made on it gets a plain pool.
        let pool = builder()
            .use_current_thread()
            .build()
            .or_else(|_| builder().build())
            .map_err(|e| KernelError::Internal(format!("cannot build thread pool: {e}")))?;
        let memory_limit = if memory_limit == 0 { physical_memory() } else { memory_limit };
        Ok(Device {
            pool,
            threads,
            memory_limit,
            precision: Default::default(),
            used: Mutex::new(0),
            buffers: Mutex::new(HashMap::new()),
        })
    }

    /// Bytes currently allocated by `alloc`.
    pub fn used_bytes(&self) -> u64 {
        *self.used.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Allocates `bytes` of zeroed, 64-byte-aligned memory and returns its handle id.
    pub fn alloc(&self, bytes: u64) -> Result<usize> {
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        let limit = self.memory_limit;
        if bytes > limit.saturating_sub(*used) || usize::try_from(bytes).is_err() {
            return Err(KernelError::OutOfMemory(format!(
                "requested {bytes} bytes but {used} of {limit} bytes are in use",
                used = *used
            )));
        }
        let len = bytes as usize;
        let (ptr, mapped) = match huge::map(len) {
            Some(m) => m,
            None => {
                // SAFETY: the layout has non-zero size (at least 1 byte).
                (unsafe { std::alloc::alloc_zeroed(layout(len)?) }, 0)
            }
        };
        if ptr.is_null() {
            return Err(KernelError::OutOfMemory(format!(
                "the system refused {bytes} bytes ({used} of {limit} bytes in use)",
                used = *used
            )));
        }
        *used += bytes;
        Ok(self.register(BufferEntry { addr: ptr as usize, len, read_only: false, mapped }))
    }

    /// Registers caller memory as a read-only buffer and returns its handle id.
    pub fn wrap_host(&self, addr: usize, bytes: u64) -> Result<usize> {
        let len =
            usize::try_from(bytes).map_err(|_| crate::invalid!("bytes = {bytes} does not fit the address space"))?;
        if addr.checked_add(len).is_none() {
            return Err(crate::invalid!("host {addr:#x} + {bytes} bytes overflows"));
        }
        Ok(self.register(BufferEntry { addr, len, read_only: true, mapped: 0 }))
    }

    fn register(&self, entry: BufferEntry) -> usize {
        let id = NEXT_HANDLE.fetch_add(16, Ordering::Relaxed);
        self.buffers.lock().unwrap_or_else(|e| e.into_inner()).insert(id, entry);
        id
    }

    /// The live buffer with handle `id`, if this device owns one.
    pub fn lookup(&self, id: usize) -> Option<BufferEntry> {
        self.buffers.lock().unwrap_or_else(|e| e.into_inner()).get(&id).copied()
    }

    /// Frees the buffer `id`; false if this device has no such live buffer.
    pub fn free(&self, id: usize) -> bool {
        let entry = self.buffers.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
        match entry {
            Some(e) => {
                self.release(e);
                true
            }
            None => false,
        }
    }

    fn release(&self, e: BufferEntry) {
        if e.read_only {
            return;
        }
        if e.mapped > 0 {
            // SAFETY: `e` came from `huge::map` with this address and length and was
            // removed from the registry, so it is unmapped once.
            unsafe { huge::unmap(e.addr as *mut u8, e.mapped) };
        } else if let Ok(layout) = layout(e.len) {
            // SAFETY: `e` came from `alloc` with exactly this layout and was removed
            // from the registry, so it is freed once.
            unsafe { std::alloc::dealloc(e.addr as *mut u8, layout) };
        }
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        *used = used.saturating_sub(e.len as u64);
    }
}

/// Large allocations as their own anonymous mappings (zeroed by the kernel), aligned to
/// 2 MiB and advised as transparent huge pages.
#[cfg(target_os = "linux")]
mod huge {
    use super::HUGE;

    /// `(address, mapped length)` of a new zeroed mapping of at least `len` bytes, or
    /// None below [`HUGE`] or when the system refuses (the caller falls back to the
    /// heap).
    pub fn map(len: usize) -> Option<(*mut u8, usize)> {
        if len < HUGE {
            return None;
        }
        let size = len.checked_next_multiple_of(HUGE)?;
        let span = size.checked_add(HUGE)?;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return None;
        }
        let base = base as usize;
        let start = base.next_multiple_of(HUGE);
        // SAFETY: the head and tail are parts of the mapping just made, outside
        // [start, start + size), and nothing refers to them.
        unsafe {
            if start > base {
                libc::munmap(base as *mut libc::c_void, start - base);
            }
            let tail = start + size;
            if base + span > tail {
                libc::munmap(tail as *mut libc::c_void, base + span - tail);
            }
            // Advice only: where transparent huge pages are off, 4 KiB pages serve.
            libc::madvise(start as *mut libc::c_void, size, libc::MADV_HUGEPAGE);
        }
        Some((start as *mut u8, size))
    }

    /// # Safety
    /// `(addr, size)` must come from [`map`], unmapped once, with no references left.
    pub unsafe fn unmap(addr: *mut u8, size: usize) {
        // SAFETY: forwarded contract.
        unsafe { libc::munmap(addr.cast(), size) };
    }
}

/// Elsewhere every allocation comes from the heap.
#[cfg(not(target_os = "linux"))]
mod huge {
    pub fn map(_len: usize) -> Option<(*mut u8, usize)> {
        None
    }

    /// # Safety
    /// Never called: `map` maps nothing.
    pub unsafe fn unmap(_addr: *mut u8, _size: usize) {}
}

impl Drop for Device {
    fn drop(&mut self) {
        let entries: Vec<BufferEntry> =
            self.buffers.lock().unwrap_or_else(|e| e.into_inner()).drain().map(|(_, e)| e).collect();
        for e in entries {
            self.release(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_buffers_are_their_own_zeroed_mappings_and_are_accounted() {
        let d = Device::new(1, 64 << 20).unwrap();
        // Below, at and beyond the huge-page size: zeroed, aligned, writable end to end.
        for bytes in [100usize, 2 << 20, (3 << 20) + 5] {
            let id = d.alloc(bytes as u64).unwrap();
            let e = d.lookup(id).unwrap();
            assert_eq!(e.len, bytes);
            assert!(e.addr.is_multiple_of(ALIGN));
            #[cfg(target_os = "linux")]
            if bytes >= HUGE {
                assert!(e.addr.is_multiple_of(HUGE) && e.mapped >= bytes && e.mapped.is_multiple_of(HUGE), "{e:?}");
            } else {
                assert_eq!(e.mapped, 0);
            }
            // SAFETY: the buffer is `bytes` long and owned by `d` until freed below.
            let mem = unsafe { std::slice::from_raw_parts_mut(e.addr as *mut u8, bytes) };
            assert!(mem.iter().all(|&b| b == 0));
            mem[bytes - 1] = 7;
            mem[0] = 9;
            assert_eq!(d.used_bytes(), bytes as u64);
            assert!(d.free(id));
            assert_eq!(d.used_bytes(), 0);
            assert!(!d.free(id));
        }
        // Buffers still live when the device goes are released with it.
        d.alloc(5 << 20).unwrap();
        drop(d);
    }
}
