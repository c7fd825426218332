//! Loads a kernel library (a shared object exporting `tessera_kernels.h`) with
//! `libloading`, checks its ABI version, resolves every symbol, and is the one place
//! in Tessera that calls into it. All `unsafe` of the data plane lives here.

use std::ffi::{CStr, c_void};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tessera_kernel_abi as abi;

use crate::error::{BackendError, Result};

/// File name the CPU kernel library gets from cargo on this platform.
#[cfg(target_os = "macos")]
pub const CPU_LIBRARY_FILE: &str = "libtessera_kernels_cpu.dylib";
#[cfg(windows)]
pub const CPU_LIBRARY_FILE: &str = "tessera_kernels_cpu.dll";
#[cfg(not(any(target_os = "macos", windows)))]
pub const CPU_LIBRARY_FILE: &str = "libtessera_kernels_cpu.so";

/// Environment variable that overrides where the default kernel library is found.
pub const KERNEL_LIB_ENV: &str = "TESSERA_KERNEL_LIB";

/// The resolved entry points of one library. Function pointers stay valid while the
/// `libloading::Library` they came from is alive, which `KernelLibrary` guarantees.
pub(crate) struct Api {
    pub last_error: abi::LastErrorFn,
    pub device_create: abi::DeviceCreateFn,
    pub device_destroy: abi::DeviceDestroyFn,
    /// Absent before ABI 1.3.
    pub set_matmul_precision: Option<abi::DeviceSetMatmulPrecisionFn>,
    /// Absent before ABI 1.4, and in a library that offers no collectives.
    pub collectives: Option<Collectives>,
    pub device_info_get: abi::DeviceInfoGetFn,
    pub synchronize: abi::SynchronizeFn,
    pub alloc: abi::AllocFn,
    pub buffer_wrap_host: abi::BufferWrapHostFn,
    pub free: abi::FreeFn,
    pub copy_h2d: abi::CopyH2dFn,
    pub copy_d2h: abi::CopyD2hFn,
    pub copy_d2d: abi::CopyD2dFn,
    pub embedding: abi::EmbeddingFn,
    pub linear: abi::LinearFn,
    pub rms_norm: abi::RmsNormFn,
    pub add_rms_norm: abi::AddRmsNormFn,
    pub apply_rotary_pos_emb: abi::ApplyRotaryPosEmbFn,
    pub silu_and_mul: abi::SiluAndMulFn,
    pub fill_kv_cache: abi::FillKvCacheFn,
    pub prefill_attention: abi::PrefillAttentionFn,
    pub paged_decode_attention: abi::PagedDecodeAttentionFn,
    pub argmax: abi::ArgmaxFn,
    pub log_softmax: abi::LogSoftmaxFn,
}

/// ABI 1.4's collective entry points, all present or none.
#[derive(Clone, Copy)]
pub(crate) struct Collectives {
    pub comm_create: abi::CommCreateFn,
    pub comm_destroy: abi::CommDestroyFn,
    pub comm_abort: abi::CommAbortFn,
    pub all_reduce_sum_f32: abi::AllReduceSumF32Fn,
}

/// A loaded, version-checked kernel library.
pub struct KernelLibrary {
    path: PathBuf,
    abi_version: (u32, u32),
    pub(crate) api: Api,
    // Dropped last: the function pointers in `api` point into it.
    _lib: libloading::Library,
}

impl std::fmt::Debug for KernelLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelLibrary").field("path", &self.path).field("abi_version", &self.abi_version).finish()
    }
}

impl KernelLibrary {
    /// Loads the library at `path`, refusing one whose ABI major differs from ours, whose
    /// minor is older than ours, or that lacks any required symbol.
    pub fn load(path: &Path) -> Result<Arc<KernelLibrary>> {
        // dlopen searches the system paths for a name without a slash; the operator
        // meant the file they named, so resolve it first.
        let path = &std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        let lib_err = |reason: String| BackendError::KernelLibrary { library: path.to_path_buf(), reason };
        if !path.exists() {
            return Err(lib_err("no such file".into()));
        }
        // SAFETY: loading a shared object runs its initialisers. A kernel library is
        // trusted code by contract (like a vendor driver); the path came from the
        // operator. Nothing else can be checked before it is loaded.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| {
            lib_err(std::error::Error::source(&e).map_or_else(|| e.to_string(), |s| format!("{e}: {s}")))
        })?;
        let (need_major, need_minor) = (abi::TK_ABI_MAJOR, abi::TK_ABI_MINOR_OLDEST);
        let missing = |symbol: &str| BackendError::MissingSymbol {
            library: path.to_path_buf(),
            symbol: symbol.to_string(),
            abi_major: need_major,
            abi_minor: need_minor,
        };
        // SAFETY: `tk_abi_version` has this signature in every ABI version; the
        // symbol is only called after the lookup succeeded.
        let version = unsafe {
            let f: libloading::Symbol<abi::AbiVersionFn> =
                lib.get(b"tk_abi_version\0").map_err(|_| missing("tk_abi_version"))?;
            f()
        };
        let (found_major, found_minor) = (version >> 16, version & 0xffff);
        if found_major != need_major || found_minor < need_minor {
            return Err(BackendError::AbiVersion {
                library: path.to_path_buf(),
                found_major,
                found_minor,
                need_major,
                need_minor,
            });
        }
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the library declared ABI `need_major`, whose header gives
                // this symbol exactly the type of the field it is stored in; the
                // pointer is used only while `lib` is alive (it is kept in `_lib`).
                let s = unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|_| missing($name))?;
                *s
            }};
        }
        macro_rules! optional {
            ($name:literal) => {
                // SAFETY: as `sym!`: the header of the minor that added the symbol gives
                // it this type; it may be absent.
                unsafe { lib.get(concat!($name, "\0").as_bytes()) }.ok().map(|s| *s)
            };
        }
        let collectives = if found_minor >= abi::TK_ABI_MINOR_COLLECTIVES {
            let found = (
                optional!("tk_comm_create"),
                optional!("tk_comm_destroy"),
                optional!("tk_comm_abort"),
                optional!("tk_all_reduce_sum_f32"),
            );
            match found {
                (Some(comm_create), Some(comm_destroy), Some(comm_abort), Some(all_reduce_sum_f32)) => {
                    Some(Collectives { comm_create, comm_destroy, comm_abort, all_reduce_sum_f32 })
                }
                (None, None, None, None) => None,
                _ => {
                    return Err(lib_err(format!(
                        "it exports some of the collectives of kernel ABI 1.4 but not all of {}; export all or none",
                        abi::COLLECTIVE_SYMBOLS.join(", ")
                    )));
                }
            }
        } else {
            None
        };
        let api = Api {
            last_error: sym!("tk_last_error"),
            device_create: sym!("tk_device_create"),
            device_destroy: sym!("tk_device_destroy"),
            // SAFETY: as `sym!`: the 1.3 header gives the symbol this type; optional.
            set_matmul_precision: optional!("tk_device_set_matmul_precision"),
            collectives,
            device_info_get: sym!("tk_device_info_get"),
            synchronize: sym!("tk_synchronize"),
            alloc: sym!("tk_alloc"),
            buffer_wrap_host: sym!("tk_buffer_wrap_host"),
            free: sym!("tk_free"),
            copy_h2d: sym!("tk_copy_h2d"),
            copy_d2h: sym!("tk_copy_d2h"),
            copy_d2d: sym!("tk_copy_d2d"),
            embedding: sym!("tk_embedding"),
            linear: sym!("tk_linear"),
            rms_norm: sym!("tk_rms_norm"),
            add_rms_norm: sym!("tk_add_rms_norm"),
            apply_rotary_pos_emb: sym!("tk_apply_rotary_pos_emb"),
            silu_and_mul: sym!("tk_silu_and_mul"),
            fill_kv_cache: sym!("tk_fill_kv_cache"),
            prefill_attention: sym!("tk_prefill_attention"),
            paged_decode_attention: sym!("tk_paged_decode_attention"),
            argmax: sym!("tk_argmax"),
            log_softmax: sym!("tk_log_softmax"),
        };
        Ok(Arc::new(KernelLibrary {
            path: path.to_path_buf(),
            abi_version: (found_major, found_minor),
            api,
            _lib: lib,
        }))
    }

    /// Loads the default CPU kernel library (see [`default_library_path`]).
    pub fn load_default() -> Result<Arc<KernelLibrary>> {
        let path = default_library_path().ok_or_else(|| BackendError::KernelLibrary {
            library: PathBuf::from(CPU_LIBRARY_FILE),
            reason: format!(
                "not found next to the executable or in its deps/ folder; build it with `cargo build` \
                 or point {KERNEL_LIB_ENV} / --kernel-lib at it"
            ),
        })?;
        Self::load(&path)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn abi_version(&self) -> (u32, u32) {
        self.abi_version
    }

    /// Whether the library sums across its own devices (ABI 1.4's collectives).
    pub fn has_collectives(&self) -> bool {
        self.api.collectives.is_some()
    }

    /// The calling thread's last error message from this library.
    pub(crate) fn last_error(&self) -> String {
        // SAFETY: `tk_last_error` returns NULL or a NUL-terminated string owned by the
        // library that stays valid until the next call on this thread; it is copied
        // out at once.
        unsafe {
            let p = (self.api.last_error)();
            if p.is_null() { String::from("(no message)") } else { CStr::from_ptr(p).to_string_lossy().into_owned() }
        }
    }
}

/// Where the default CPU kernel library is: `$TESSERA_KERNEL_LIB` if set, else beside
/// the running executable — cargo puts it in `target/<profile>/deps/`, next to test
/// binaries and one level below `target/<profile>/tessera`.
///
/// When both `dir/` and `dir/deps/` hold one, the newer wins: `cargo build` copies the
/// library up to `target/<profile>/` but `cargo test` only rebuilds the one in `deps/`,
/// so the copy beside the binary can be stale (an older ABI) while `deps/` is current.
pub fn default_library_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(KERNEL_LIB_ENV) {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    let candidates = [dir.join(CPU_LIBRARY_FILE), dir.join("deps").join(CPU_LIBRARY_FILE)];
    let modified = |p: &PathBuf| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let mut found = candidates.into_iter().filter(|p| p.is_file());
    let first = found.next()?;
    Some(found.fold(first, |best, p| if modified(&p) > modified(&best) { p } else { best }))
}

/// Raw calls used by `device.rs`. Each takes the library and validated arguments; the
/// handles they receive were produced by the same library.
pub(crate) mod raw {
    use super::*;

    /// `Err` carries `TK_ERR_UNSUPPORTED` and a message when the library has no
    /// `tk_device_set_matmul_precision` (before ABI 1.3).
    pub fn set_matmul_precision(
        lib: &KernelLibrary,
        dev: *mut abi::TkDevice,
        precision: u32,
    ) -> std::result::Result<(), (abi::TkStatus, String)> {
        let Some(set) = lib.api.set_matmul_precision else {
            let (major, minor) = lib.abi_version;
            return Err((
                abi::TK_ERR_UNSUPPORTED,
                format!("the library speaks kernel ABI {major}.{minor}; choosing the precision needs 1.3"),
            ));
        };
        // SAFETY: `dev` came from this library's `tk_device_create` and is not yet used
        // by another thread.
        let status = unsafe { set(dev, precision) };
        if status != abi::TK_OK {
            return Err((status, lib.last_error()));
        }
        Ok(())
    }

    /// `tk_comm_create`; the library must have collectives.
    pub fn comm_create(
        lib: &KernelLibrary,
        ranks: u32,
    ) -> std::result::Result<*mut abi::TkComm, (abi::TkStatus, String)> {
        let Some(c) = lib.api.collectives else {
            return Err((abi::TK_ERR_UNSUPPORTED, "the library has no collectives".into()));
        };
        let mut out = std::ptr::null_mut();
        // SAFETY: `out` is a valid out-pointer.
        let status = unsafe { (c.comm_create)(ranks, &mut out) };
        if status != abi::TK_OK || out.is_null() {
            return Err((status, lib.last_error()));
        }
        Ok(out)
    }

    pub fn comm_destroy(lib: &KernelLibrary, comm: *mut abi::TkComm) {
        if let Some(c) = lib.api.collectives {
            // SAFETY: `comm` came from this library's `tk_comm_create` and is destroyed
            // once, when its last owner (every rank is done) drops it.
            unsafe { (c.comm_destroy)(comm) }
        }
    }

    pub fn comm_abort(lib: &KernelLibrary, comm: *mut abi::TkComm) -> abi::TkStatus {
        match lib.api.collectives {
            // SAFETY: `comm` is live (its owner holds it); abort is thread-safe.
            Some(c) => unsafe { (c.comm_abort)(comm) },
            None => abi::TK_ERR_UNSUPPORTED,
        }
    }

    pub fn all_reduce_sum_f32(
        lib: &KernelLibrary,
        comm: *mut abi::TkComm,
        rank: u32,
        dev: *mut abi::TkDevice,
        buf: abi::TkPtr,
        count: u64,
        timeout_ms: u32,
    ) -> abi::TkStatus {
        match lib.api.collectives {
            // SAFETY: `comm` is live; `dev` is this thread's device of the same library
            // and `buf` one of its buffers (borrowed by the caller for the call), which
            // the library bounds-checks.
            Some(c) => unsafe { (c.all_reduce_sum_f32)(comm, rank, dev, buf, count, timeout_ms) },
            None => abi::TK_ERR_UNSUPPORTED,
        }
    }

    pub fn device_create(
        lib: &KernelLibrary,
        config: &abi::TkDeviceConfig,
    ) -> std::result::Result<*mut abi::TkDevice, (abi::TkStatus, String)> {
        let mut out = std::ptr::null_mut();
        // SAFETY: `config` and `out` are valid for the call's duration.
        let status = unsafe { (lib.api.device_create)(config, &mut out) };
        if status != abi::TK_OK || out.is_null() {
            return Err((status, lib.last_error()));
        }
        Ok(out)
    }

    pub fn device_destroy(lib: &KernelLibrary, dev: *mut abi::TkDevice) {
        // SAFETY: `dev` came from `tk_device_create` of this library and is destroyed
        // once, when the last owner drops it.
        unsafe { (lib.api.device_destroy)(dev) }
    }

    pub fn device_info(lib: &KernelLibrary, dev: *mut abi::TkDevice) -> (abi::TkStatus, abi::TkDeviceInfo) {
        let mut info = abi::TkDeviceInfo::default();
        // SAFETY: `info` is a valid out-pointer of the declared struct.
        let status = unsafe { (lib.api.device_info_get)(dev, &mut info) };
        (status, info)
    }

    pub fn alloc(lib: &KernelLibrary, dev: *mut abi::TkDevice, bytes: u64) -> (abi::TkStatus, *mut abi::TkBuffer) {
        let mut out = std::ptr::null_mut();
        // SAFETY: `out` is a valid out-pointer.
        let status = unsafe { (lib.api.alloc)(dev, bytes, &mut out) };
        (status, out)
    }

    /// # Safety contract (checked by the caller)
    /// `host[..]` must stay alive and unmodified until the buffer is freed.
    pub fn wrap_host(lib: &KernelLibrary, dev: *mut abi::TkDevice, host: &[u8]) -> (abi::TkStatus, *mut abi::TkBuffer) {
        let mut out = std::ptr::null_mut();
        // SAFETY: `host` is valid for reads of its length; the caller keeps it alive
        // for the buffer's life (device.rs stores its owner inside the Buffer).
        let status =
            unsafe { (lib.api.buffer_wrap_host)(dev, host.as_ptr() as *const c_void, host.len() as u64, &mut out) };
        (status, out)
    }

    pub fn free(lib: &KernelLibrary, dev: *mut abi::TkDevice, buf: *mut abi::TkBuffer) -> abi::TkStatus {
        // SAFETY: `buf` came from this device and is freed once (Buffer's Drop).
        unsafe { (lib.api.free)(dev, buf) }
    }

    pub fn copy_h2d(lib: &KernelLibrary, dev: *mut abi::TkDevice, dst: abi::TkPtr, src: &[u8]) -> abi::TkStatus {
        // SAFETY: `src` is valid for reads of its length; the library bounds-checks dst.
        unsafe { (lib.api.copy_h2d)(dev, dst, src.as_ptr() as *const c_void, src.len() as u64) }
    }

    pub fn copy_d2h(lib: &KernelLibrary, dev: *mut abi::TkDevice, dst: &mut [u8], src: abi::TkPtr) -> abi::TkStatus {
        // SAFETY: `dst` is valid for writes of its length; the library bounds-checks src.
        unsafe { (lib.api.copy_d2h)(dev, dst.as_mut_ptr() as *mut c_void, src, dst.len() as u64) }
    }

    pub fn synchronize(lib: &KernelLibrary, dev: *mut abi::TkDevice) -> abi::TkStatus {
        // SAFETY: `dev` is a live device of this library.
        unsafe { (lib.api.synchronize)(dev) }
    }

    /// Generates a wrapper per op whose arguments are plain data and tensor handles.
    macro_rules! raw_op {
        ($name:ident($($arg:ident: $ty:ty),*)) => {
            #[allow(clippy::too_many_arguments)]
            pub fn $name(lib: &KernelLibrary, dev: *mut abi::TkDevice, $($arg: $ty),*) -> abi::TkStatus {
                // SAFETY: every handle inside the arguments belongs to this library's
                // live device (the safe wrapper borrows the owning Buffers for the
                // call); struct references outlive the call; the library checks every
                // tensor against its buffer's bounds.
                unsafe { (lib.api.$name)(dev, $($arg),*) }
            }
        };
    }

    raw_op!(embedding(out: abi::TkPtr, table: abi::TkPtr, dtype: abi::TkDtype, ids: abi::TkPtr, n: u32, hidden: u32, vocab: u32));
    raw_op!(linear(out: abi::TkPtr, x: abi::TkPtr, w: abi::TkPtr, dtype: abi::TkDtype, bias: abi::TkPtr, m: u32, n: u32, k: u32));
    raw_op!(rms_norm(out: abi::TkPtr, x: abi::TkPtr, w: abi::TkPtr, dtype: abi::TkDtype, n: u32, hidden: u32, eps: f32));
    raw_op!(add_rms_norm(residual: abi::TkPtr, x: abi::TkPtr, w: abi::TkPtr, dtype: abi::TkDtype, out: abi::TkPtr, n: u32, hidden: u32, eps: f32));
    raw_op!(silu_and_mul(out: abi::TkPtr, gate: abi::TkPtr, up: abi::TkPtr, n: u32, inter: u32));
    raw_op!(argmax(out: abi::TkPtr, logits: abi::TkPtr, n: u32, vocab: u32));
    raw_op!(log_softmax(out: abi::TkPtr, logits: abi::TkPtr, n: u32, vocab: u32));
    raw_op!(copy_d2d(dst: abi::TkPtr, src: abi::TkPtr, bytes: u64));

    #[allow(clippy::too_many_arguments)]
    pub fn apply_rotary_pos_emb(
        lib: &KernelLibrary,
        dev: *mut abi::TkDevice,
        q: abi::TkPtr,
        k: abi::TkPtr,
        positions: abi::TkPtr,
        n: u32,
        num_heads: u32,
        num_kv_heads: u32,
        head_dim: u32,
        rope: &abi::TkRope,
    ) -> abi::TkStatus {
        // SAFETY: as for the ops above; `rope` outlives the call.
        unsafe { (lib.api.apply_rotary_pos_emb)(dev, q, k, positions, n, num_heads, num_kv_heads, head_dim, rope) }
    }

    pub fn fill_kv_cache(
        lib: &KernelLibrary,
        dev: *mut abi::TkDevice,
        cache: &abi::TkKvCache,
        k: abi::TkPtr,
        v: abi::TkPtr,
        slots: abi::TkPtr,
        n: u32,
    ) -> abi::TkStatus {
        // SAFETY: as for the ops above; `cache` outlives the call.
        unsafe { (lib.api.fill_kv_cache)(dev, cache, k, v, slots, n) }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn prefill_attention(
        lib: &KernelLibrary,
        dev: *mut abi::TkDevice,
        out: abi::TkPtr,
        q: abi::TkPtr,
        cache: &abi::TkKvCache,
        batch: &abi::TkAttnBatch,
        total_q: u32,
        num_heads: u32,
        scale: f32,
    ) -> abi::TkStatus {
        // SAFETY: as for the ops above; `cache` and `batch` outlive the call.
        unsafe { (lib.api.prefill_attention)(dev, out, q, cache, batch, total_q, num_heads, scale) }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn paged_decode_attention(
        lib: &KernelLibrary,
        dev: *mut abi::TkDevice,
        out: abi::TkPtr,
        q: abi::TkPtr,
        cache: &abi::TkKvCache,
        block_tables: abi::TkPtr,
        context_lens: abi::TkPtr,
        num_seqs: u32,
        max_blocks_per_seq: u32,
        num_heads: u32,
        scale: f32,
    ) -> abi::TkStatus {
        // SAFETY: as for the ops above; `cache` outlives the call.
        unsafe {
            (lib.api.paged_decode_attention)(
                dev,
                out,
                q,
                cache,
                block_tables,
                context_lens,
                num_seqs,
                max_blocks_per_seq,
                num_heads,
                scale,
            )
        }
    }
}

/// A live device handle; destroyed when the last owner (the `Device` or one of its
/// buffers) drops it.
pub(crate) struct RawDevice {
    pub lib: Arc<KernelLibrary>,
    pub ptr: *mut abi::TkDevice,
}

// SAFETY: the ABI makes memory calls (alloc/wrap/free) thread-safe and ops are issued
// from one thread at a time, which `Device` enforces by being `!Sync`. Buffers share
// this handle only to free themselves.
unsafe impl Send for RawDevice {}
// SAFETY: see above; shared access is limited to the thread-safe memory calls.
unsafe impl Sync for RawDevice {}

impl Drop for RawDevice {
    fn drop(&mut self) {
        raw::device_destroy(&self.lib, self.ptr);
    }
}

/// A communicator handle (ABI 1.4); destroyed on drop, when its last owner (every
/// rank is done with it) drops it.
pub(crate) struct RawComm {
    pub lib: Arc<KernelLibrary>,
    pub ptr: *mut abi::TkComm,
}

// SAFETY: a communicator is made to be called from every rank's thread at once
// (tk_all_reduce_sum_f32 and tk_comm_abort are thread-safe by the ABI); it is destroyed
// only by Drop, when no call can be running.
unsafe impl Send for RawComm {}
// SAFETY: see above.
unsafe impl Sync for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        raw::comm_destroy(&self.lib, self.ptr);
    }
}

/// A buffer handle; freed on drop. Holding the device keeps it alive until then, and
/// `_owner` keeps any wrapped host memory alive.
pub(crate) struct RawBuffer {
    pub dev: Arc<RawDevice>,
    pub ptr: *mut abi::TkBuffer,
    pub _owner: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

// SAFETY: a buffer handle is an opaque token; freeing it is thread-safe per the ABI.
unsafe impl Send for RawBuffer {}
// SAFETY: shared references only read the handle value.
unsafe impl Sync for RawBuffer {}

impl Drop for RawBuffer {
    fn drop(&mut self) {
        // A failing free leaves nothing to recover; the library reports it in its log.
        let _ = raw::free(&self.dev.lib, self.dev.ptr, self.ptr);
    }
}
