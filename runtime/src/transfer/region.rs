//! Registered memory and the peers' mappings of it: the one module of the transfer
//! engine that holds `unsafe` (memfd_create, mmap, raw copies).
//!
//! A [`Region`] is a memfd mapped `MAP_SHARED` into this process. Another process on the
//! same host maps the same pages read-only through `/proc/<pid>/fd/<fd>` (a
//! [`PeerMapping`]) and copies straight out of them; no byte passes through a socket.
//!
//! Invariants:
//! - Every access to a region's memory from this process goes through a bounds-checked
//!   borrow ([`Region::with_ref`] / [`Region::with_mut`]) recorded in the region's borrow
//!   table: a range lent mutably overlaps no other live borrow, so the slices handed out
//!   never alias a `&mut`. A conflicting borrow is refused ([`TransferError::RangeBusy`]),
//!   never waited for.
//! - Peers in *other processes* are outside that table: a peer reading while the owner
//!   writes the same bytes sees some mix of old and new bytes (as with any shared
//!   memory). Ordering writes before reads is the control plane's job (the bus says
//!   "blocks ready").
//! - A mapping stays valid for as long as it exists, whatever its owner does: after the
//!   owner unregisters (or drops) a region, a peer's existing mapping still reads the
//!   same pages; the kernel frees them when the last mapping and descriptor go.
#![allow(unsafe_code)]

use std::collections::hash_map::RandomState;
use std::ffi::CString;
use std::fs::File;
use std::hash::BuildHasher;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::{RegionDesc, TransferError};

/// Region ids: a per-process random base plus a counter, so ids of regions in different
/// processes (and pid namespaces) do not collide and `(pid, id)` names one region.
fn next_region_id() -> u64 {
    static BASE: OnceLock<u64> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(1);
    let base = *BASE.get_or_init(|| RandomState::new().hash_one(std::process::id()) & !0xffff_ffff);
    base | (COUNTER.fetch_add(1, Ordering::Relaxed) & 0xffff_ffff)
}

/// The memfd name a region's descriptor shows in `/proc/<pid>/fd` (as
/// `/memfd:<name> (deleted)`); a peer checks it to be sure it opened that region.
fn memfd_name(id: u64) -> String {
    format!("tessera-region-{id:016x}")
}

/// An `mmap`ed range, unmapped on drop.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a Mapping is a plain pointer to process-wide memory that it alone unmaps; the
// accesses through it are synchronised by the region's borrow table (local regions) or
// are read-only copies (peer mappings).
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` exposes no unsynchronised mutation.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len > 0` bytes of `fd` shared. Not prefaulted: a memfd's pages are allocated
    /// when first written, so a large region (a chip's whole staging mirror) costs only
    /// the blocks actually staged, on the writer and on every reader. The first copy of
    /// a page pays its fault; later ones do not.
    fn new(fd: RawFd, len: usize, writable: bool) -> io::Result<Mapping> {
        let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        // SAFETY: asks the kernel for a fresh mapping at an address of its choosing; no
        // existing memory of this process is touched. `fd` is open for the call.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Mapping { ptr, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned, and no borrow of the memory
        // outlives the Mapping (borrows hold an Arc of their region).
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        if rc != 0 {
            tracing::warn!("munmap of a transfer region failed: {}", io::Error::last_os_error());
        }
    }
}

/// One live borrow of a region's bytes `[start, end)`.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Borrow {
    start: usize,
    end: usize,
    exclusive: bool,
}

struct RegionInner {
    id: u64,
    fd: OwnedFd,
    map: Mapping,
    borrows: Mutex<Vec<Borrow>>,
}

/// Memory registered with a transfer engine: a memfd mapped shared into this process,
/// zero-filled at creation. Cheap to clone (an `Arc`); the memory lives until the last
/// clone is dropped, whether or not the engine still lists it.
#[derive(Clone)]
pub struct Region {
    inner: Arc<RegionInner>,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("id", &self.inner.id).field("len", &self.inner.map.len).finish()
    }
}

/// Removes its borrow from the table when the closure returns (or panics).
struct BorrowGuard<'a> {
    region: &'a RegionInner,
    borrow: Borrow,
}

impl Drop for BorrowGuard<'_> {
    fn drop(&mut self) {
        let mut borrows = self.region.borrows.lock();
        if let Some(i) = borrows.iter().position(|b| *b == self.borrow) {
            borrows.swap_remove(i);
        }
    }
}

impl Region {
    /// Creates a zero-filled region of `len` bytes (`len > 0`).
    pub(crate) fn create(len: usize) -> Result<Region, TransferError> {
        let register_err = |source: io::Error| TransferError::Register { len, source };
        if len == 0 {
            return Err(register_err(io::Error::new(io::ErrorKind::InvalidInput, "a region must not be empty")));
        }
        let id = next_region_id();
        let name = CString::new(memfd_name(id)).map_err(|e| register_err(io::Error::other(e)))?;
        // SAFETY: `name` is a valid NUL-terminated string for the duration of the call.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(register_err(io::Error::last_os_error()));
        }
        // SAFETY: memfd_create just returned this descriptor; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let file = File::from(fd);
        file.set_len(len as u64).map_err(register_err)?;
        let fd = OwnedFd::from(file);
        // Sealed at its size: nobody (a peer opening /proc/<pid>/fd included) can shrink
        // it under a mapping, which would turn a peer's copy into SIGBUS.
        // SAFETY: F_ADD_SEALS on a descriptor we own, with an integer argument.
        let rc = unsafe {
            libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL)
        };
        if rc != 0 {
            return Err(register_err(io::Error::last_os_error()));
        }
        let map = Mapping::new(fd.as_raw_fd(), len, true).map_err(register_err)?;
        Ok(Region { inner: Arc::new(RegionInner { id, fd, map, borrows: Mutex::new(Vec::new()) }) })
    }

    /// The region's id, unique across processes (with overwhelming probability).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    pub fn len(&self) -> usize {
        self.inner.map.len
    }

    /// Always false: empty regions cannot be registered.
    pub fn is_empty(&self) -> bool {
        self.inner.map.len == 0
    }

    /// The memfd's descriptor number in this process (what a peer opens in /proc).
    pub(crate) fn raw_fd(&self) -> RawFd {
        self.inner.fd.as_raw_fd()
    }

    fn check(&self, offset: usize, len: usize) -> Result<usize, TransferError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(end),
            _ => Err(TransferError::OutOfBounds {
                side: "local",
                region: self.id(),
                offset: offset as u64,
                len: len as u64,
                region_len: self.len() as u64,
            }),
        }
    }

    fn borrow(&self, offset: usize, len: usize, exclusive: bool) -> Result<BorrowGuard<'_>, TransferError> {
        let end = self.check(offset, len)?;
        let borrow = Borrow { start: offset, end, exclusive };
        let mut borrows = self.inner.borrows.lock();
        let overlaps = |b: &&Borrow| b.start < end && offset < b.end && (exclusive || b.exclusive);
        if len > 0
            && let Some(busy) = borrows.iter().find(overlaps)
        {
            return Err(TransferError::RangeBusy {
                region: self.id(),
                offset: offset as u64,
                len: len as u64,
                busy_start: busy.start as u64,
                busy_end: busy.end as u64,
            });
        }
        borrows.push(borrow);
        Ok(BorrowGuard { region: &self.inner, borrow })
    }

    /// Lends bytes `[offset, offset + len)` read-only to `f` (e.g. to write them to a
    /// socket or a device). Refused if that range is lent mutably right now.
    pub fn with_ref<R>(&self, offset: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> Result<R, TransferError> {
        let _guard = self.borrow(offset, len, false)?;
        // SAFETY: the range is inside the mapping (checked by `borrow`), which lives as
        // long as `self`; the borrow table guarantees no `&mut` to an overlapping range
        // exists until `_guard` drops, after `f` returns.
        let bytes = unsafe { std::slice::from_raw_parts(self.inner.map.ptr.as_ptr().add(offset), len) };
        Ok(f(bytes))
    }

    /// Lends bytes `[offset, offset + len)` mutably to `f` (e.g. a device-to-host copy
    /// straight into the region). Refused if any part of the range is lent right now.
    pub fn with_mut<R>(&self, offset: usize, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> Result<R, TransferError> {
        let _guard = self.borrow(offset, len, true)?;
        // SAFETY: in bounds (checked by `borrow`); the borrow table guarantees this is
        // the only live reference to these bytes in this process until `_guard` drops.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.inner.map.ptr.as_ptr().add(offset), len) };
        Ok(f(bytes))
    }

    /// Copies `data` into the region at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), TransferError> {
        self.with_mut(offset, data.len(), |dst| dst.copy_from_slice(data))
    }

    /// Copies bytes at `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), TransferError> {
        self.with_ref(offset, out.len(), |src| out.copy_from_slice(src))
    }

    /// Copies `len` bytes of a peer's region (at `src_offset`) into this one (at
    /// `dst_offset`): a plain memcpy from the writer's pages.
    pub(crate) fn copy_from_peer(
        &self,
        peer: &PeerMapping,
        src_offset: usize,
        dst_offset: usize,
        len: usize,
        streaming: bool,
    ) -> Result<(), TransferError> {
        match src_offset.checked_add(len) {
            Some(end) if end <= peer.map.len => {}
            _ => {
                return Err(TransferError::OutOfBounds {
                    side: "remote",
                    region: peer.region,
                    offset: src_offset as u64,
                    len: len as u64,
                    region_len: peer.map.len as u64,
                });
            }
        }
        self.with_mut(dst_offset, len, |dst| {
            // SAFETY: the source range is inside the peer mapping (checked above), which
            // `peer` keeps mapped; the destination is an exclusively borrowed slice of
            // another mapping (a separate virtual range, so the two do not overlap). The
            // writer may change the source pages concurrently: the bytes are then a mix,
            // as documented, but the copy itself stays within valid memory.
            let src = unsafe { peer.map.ptr.as_ptr().add(src_offset) };
            if streaming {
                copy_streaming(src, dst);
            } else {
                // SAFETY: as above: `src..src + len` is readable, `dst` is `len` bytes.
                unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), len) }
            }
        })
    }
}

/// A peer's region on this host, mapped read-only into this process.
pub(crate) struct PeerMapping {
    region: u64,
    map: Mapping,
}

impl PeerMapping {
    /// Opens `/proc/<pid>/fd/<fd>` of the region's owner and maps its `len` bytes.
    /// The error says which step failed.
    pub(crate) fn open(desc: &RegionDesc) -> Result<PeerMapping, String> {
        let path = format!("/proc/{}/fd/{}", desc.endpoint.pid, desc.fd);
        let file = File::open(&path).map_err(|e| format!("cannot open {path}: {e}"))?;
        // What we opened must be that region's memfd, not a reused descriptor number.
        let opened = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
            .map_err(|e| format!("cannot inspect the descriptor opened from {path}: {e}"))?;
        let expected = format!("/memfd:{}", memfd_name(desc.region));
        if !opened.to_string_lossy().starts_with(&expected) {
            return Err(format!("{path} is {} rather than region {}'s memfd", opened.display(), desc.region));
        }
        let size = file.metadata().map_err(|e| format!("cannot stat {path}: {e}"))?.len();
        if size < desc.len || desc.len == 0 {
            return Err(format!("{path} holds {size} bytes but the descriptor says {}", desc.len));
        }
        let len = usize::try_from(desc.len).map_err(|_| format!("region length {} does not fit memory", desc.len))?;
        let map = Mapping::new(file.as_raw_fd(), len, false).map_err(|e| format!("cannot mmap {path}: {e}"))?;
        Ok(PeerMapping { region: desc.region, map })
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len
    }
}

/// Copies `dst.len()` bytes from `src` with non-temporal stores where the CPU has them:
/// for a transfer larger than the caches, writing around them saves reading every
/// destination line first (what a large `memcpy` does too). Falls back to a plain copy.
fn copy_streaming(src: *const u8, dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let len = dst.len();
        let d = dst.as_mut_ptr();
        let head = ((16 - (d as usize & 15)) & 15).min(len);
        // SAFETY: the caller guarantees `src..src + len` is readable and disjoint from
        // `dst`. Every access below stays below `len`: the head up to the first 16-byte
        // aligned destination byte, 64-byte blocks while a whole one fits (stores to
        // 16-aligned addresses, as `_mm_stream_si128` needs; loads unaligned), then the
        // tail. SSE2 is part of the x86_64 baseline. The fence orders the streaming
        // stores before whatever the caller does next.
        unsafe {
            std::ptr::copy_nonoverlapping(src, d, head);
            let mut i = head;
            while i + 64 <= len {
                let s = src.add(i) as *const __m128i;
                let t = d.add(i) as *mut __m128i;
                let (a, b, c, e) = (
                    _mm_loadu_si128(s),
                    _mm_loadu_si128(s.add(1)),
                    _mm_loadu_si128(s.add(2)),
                    _mm_loadu_si128(s.add(3)),
                );
                _mm_stream_si128(t, a);
                _mm_stream_si128(t.add(1), b);
                _mm_stream_si128(t.add(2), c);
                _mm_stream_si128(t.add(3), e);
                i += 64;
            }
            std::ptr::copy_nonoverlapping(src.add(i), d.add(i), len - i);
            _mm_sfence();
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller guarantees `src..src + dst.len()` is readable and disjoint.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len())
    }
}
