//! The exported C ABI. Every function validates its handles and tensor arguments,
//! converts them to slices and calls the safe implementation in [`crate::ops`] inside
//! the device's thread pool. Panics are caught; nothing unwinds across the ABI.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashSet;
use std::ffi::{CString, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;

use half::{bf16, f16};
use tessera_kernel_abi::*;

use crate::comm::Comm;
use crate::device::Device;
use crate::dtype::{DType, WSlice, WSliceMut, WType};
use crate::error::{KernelError, Result};
use crate::invalid;
use crate::ops::prefill_gemm::{self, Precision};
use crate::ops::{
    self,
    attention::KvView,
    misc::{KvGeom, KvLayout},
};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Addresses of live devices, so a stale or foreign device handle is refused.
static LIVE_DEVICES: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

/// Addresses of live communicators (ABI 1.4), so a stale or foreign handle is refused.
static LIVE_COMMS: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

fn set_last_error(msg: String) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// Runs `f`, turning errors and panics into a status and the last-error message.
fn guard(op: &str, f: impl FnOnce() -> Result<()>) -> TkStatus {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => TK_OK,
        Ok(Err(e)) => {
            set_last_error(format!("{op}: {e}"));
            e.status()
        }
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(format!("{op}: internal error: {what}"));
            TK_ERR_INTERNAL
        }
    }
}

fn device<'a>(dev: *mut TkDevice) -> Result<&'a Device> {
    let live = LIVE_DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    if dev.is_null() || !live.as_ref().is_some_and(|s| s.contains(&(dev as usize))) {
        return Err(invalid!("dev {dev:p} is not a live device of this library"));
    }
    // SAFETY: the address is in LIVE_DEVICES, so it is a Box<Device> we leaked in
    // tk_device_create and have not yet dropped (devices are used by one host thread
    // at a time, so it cannot be destroyed during this call).
    Ok(unsafe { &*(dev as *const Device) })
}

/// A validated tensor argument: an address range inside a live buffer.
#[derive(Debug, Clone, Copy)]
struct Arg {
    addr: usize,
    bytes: usize,
}

impl Arg {
    fn overlaps(&self, o: &Arg) -> bool {
        self.bytes > 0 && o.bytes > 0 && self.addr < o.addr + o.bytes && o.addr < self.addr + self.bytes
    }
}

fn nbytes(name: &str, dims: &[usize], elem: usize) -> Result<usize> {
    dims.iter()
        .try_fold(elem, |a, &d| a.checked_mul(d))
        .ok_or_else(|| invalid!("{name}: size {dims:?} x {elem} bytes overflows"))
}

/// Resolves `p` as a tensor of `count` elements of `elem` bytes.
fn arg(dev: &Device, name: &str, p: TkPtr, count: usize, elem: usize, write: bool) -> Result<Arg> {
    let bytes = nbytes(name, &[count], elem)?;
    if p.buf.is_null() {
        return Err(invalid!("{name} is a null buffer"));
    }
    let b = dev
        .lookup(p.buf as usize)
        .ok_or_else(|| invalid!("{name} buffer {:p} is not a live buffer of this device", p.buf))?;
    let off = p.offset;
    if off.checked_add(bytes as u64).is_none_or(|end| end > b.len as u64) {
        return Err(invalid!("{name} needs {bytes} bytes at offset {off} but buffer holds {}", b.len));
    }
    let addr = b.addr + off as usize;
    if !addr.is_multiple_of(elem) {
        return Err(invalid!("{name} at offset {off} (address {addr:#x}) is not aligned to its {elem}-byte elements"));
    }
    if write && b.read_only {
        return Err(invalid!("{name} is a read-only (wrapped host) buffer and cannot be written"));
    }
    Ok(Arg { addr, bytes })
}

fn check_disjoint(pairs: &[(&str, &Arg, &str, &Arg)]) -> Result<()> {
    for (an, a, bn, b) in pairs {
        if a.overlaps(b) {
            return Err(invalid!("{an} and {bn} overlap"));
        }
    }
    Ok(())
}

/// An input slice; copied if it overlaps any output so that no `&` and `&mut` alias.
/// Must be called before any output slice is created.
fn input<'a, T: Copy>(a: &Arg, outputs: &[&Arg]) -> Cow<'a, [T]> {
    let n = a.bytes / size_of::<T>();
    // SAFETY: `a` was validated by `arg` (inside a live buffer, aligned for T, and
    // the device is used by one thread so the buffer lives through this call); T is a
    // plain numeric type valid for any bit pattern.
    let s: &'a [T] = unsafe { std::slice::from_raw_parts(a.addr as *const T, n) };
    if outputs.iter().any(|o| o.overlaps(a)) { Cow::Owned(s.to_vec()) } else { Cow::Borrowed(s) }
}

/// An output slice. Callers ensure it overlaps no other live slice.
///
/// # Safety
/// `a` must come from `arg(.., write = true)` and be disjoint from every other slice
/// alive at the same time.
unsafe fn output<'a, T>(a: &Arg) -> &'a mut [T] {
    // SAFETY: see the function contract; the buffer is writable (not wrapped).
    unsafe { std::slice::from_raw_parts_mut(a.addr as *mut T, a.bytes / size_of::<T>()) }
}

enum WCow<'a> {
    F32(Cow<'a, [f32]>),
    F16(Cow<'a, [f16]>),
    Bf16(Cow<'a, [bf16]>),
    Quant(tessera_quant::GgmlType, Cow<'a, [u8]>),
}

impl WCow<'_> {
    fn view(&self) -> WSlice<'_> {
        match self {
            WCow::F32(c) => WSlice::F32(c),
            WCow::F16(c) => WSlice::F16(c),
            WCow::Bf16(c) => WSlice::Bf16(c),
            WCow::Quant(q, c) => WSlice::Quant(*q, c),
        }
    }
}

/// A weight input that may be quantized (see [`winput`]).
fn wtinput<'a>(wt: WType, a: &Arg, outputs: &[&Arg]) -> WCow<'a> {
    match wt {
        WType::Float(dt) => winput(dt, a, outputs),
        WType::Quant(q) => WCow::Quant(q, input(a, outputs)),
    }
}

fn winput<'a>(dt: DType, a: &Arg, outputs: &[&Arg]) -> WCow<'a> {
    match dt {
        DType::F32 => WCow::F32(input(a, outputs)),
        DType::F16 => WCow::F16(input(a, outputs)),
        DType::Bf16 => WCow::Bf16(input(a, outputs)),
    }
}

/// # Safety
/// As for [`output`].
unsafe fn woutput<'a>(dt: DType, a: &Arg) -> WSliceMut<'a> {
    // SAFETY: forwarded contract.
    unsafe {
        match dt {
            DType::F32 => WSliceMut::F32(output(a)),
            DType::F16 => WSliceMut::F16(output(a)),
            DType::Bf16 => WSliceMut::Bf16(output(a)),
        }
    }
}

fn read_struct<'a, T>(p: *const T, name: &str) -> Result<&'a T> {
    if p.is_null() {
        return Err(invalid!("{name} is null"));
    }
    // SAFETY: non-null; the ABI requires the caller to pass a valid, aligned struct.
    Ok(unsafe { &*p })
}

fn check_out_ptr<T>(out: *mut T, name: &str) -> Result<()> {
    if out.is_null() { Err(invalid!("{name} is null")) } else { Ok(()) }
}

// ---- library and device --------------------------------------------------------

/// # Safety
/// Every handle and tensor argument is validated; host pointers (none here
/// beyond the handles) follow the C ABI contract in `tessera_kernels.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_abi_version() -> u32 {
    abi_version(TK_ABI_MAJOR, TK_ABI_MINOR)
}

/// # Safety
/// Every handle and tensor argument is validated; host pointers (none here
/// beyond the handles) follow the C ABI contract in `tessera_kernels.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// # Safety
/// `config` must be null or point to a valid config; `out` null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_device_create(config: *const TkDeviceConfig, out: *mut *mut TkDevice) -> TkStatus {
    guard("tk_device_create", || {
        check_out_ptr(out, "out")?;
        let cfg = *read_struct(config, "config")?;
        let dev = Device::new(cfg.threads, cfg.memory_limit_bytes)?;
        let p = Box::into_raw(Box::new(dev));
        LIVE_DEVICES.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashSet::new).insert(p as usize);
        // SAFETY: out is non-null and, per the ABI, writable.
        unsafe { *out = p as *mut TkDevice };
        Ok(())
    })
}

/// # Safety
/// `dev` must not be used by another thread during the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_device_destroy(dev: *mut TkDevice) {
    let _ = guard("tk_device_destroy", || {
        let removed =
            LIVE_DEVICES.lock().unwrap_or_else(|e| e.into_inner()).as_mut().is_some_and(|s| s.remove(&(dev as usize)));
        if removed {
            // SAFETY: the address was live (created by Box::into_raw) and is now
            // removed from the set, so it is dropped exactly once.
            drop(unsafe { Box::from_raw(dev as *mut Device) });
        }
        Ok(())
    });
}

/// # Safety
/// `out` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_device_info_get(dev: *mut TkDevice, out: *mut TkDeviceInfo) -> TkStatus {
    guard("tk_device_info_get", || {
        let d = device(dev)?;
        check_out_ptr(out, "out")?;
        let mut info = TkDeviceInfo::default();
        let name = format!("cpu ({} threads, {})", d.threads, crate::simd::IsaLevel::in_use().name());
        for (dst, b) in info.name.iter_mut().zip(name.bytes().take(63)) {
            *dst = b as c_char;
        }
        info.memory_bytes = d.memory_limit;
        info.compute_units = d.threads as u32;
        info.host_memory_shared = 1;
        // SAFETY: out is non-null and writable per the ABI.
        unsafe { *out = info };
        Ok(())
    })
}

/// # Safety
/// Every handle and tensor argument is validated; host pointers (none here
/// beyond the handles) follow the C ABI contract in `tessera_kernels.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_synchronize(dev: *mut TkDevice) -> TkStatus {
    // Every op completes before it returns.
    guard("tk_synchronize", || device(dev).map(|_| ()))
}

/// # Safety
/// `dev` must not be used by another thread during the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_device_set_matmul_precision(dev: *mut TkDevice, precision: u32) -> TkStatus {
    guard("tk_device_set_matmul_precision", || {
        let d = device(dev)?;
        let p = match precision {
            TK_MATMUL_F32 => Precision::F32,
            TK_MATMUL_BF16 if prefill_gemm::bf16_available() => Precision::Bf16,
            TK_MATMUL_BF16 => {
                return Err(KernelError::Unsupported(
                    "bf16 matmuls need a CPU with AVX512-BF16 (bf16 dot products); this one has none".into(),
                ));
            }
            other => {
                return Err(invalid!(
                    "precision = {other} is none of TK_MATMUL_F32 ({TK_MATMUL_F32}) or TK_MATMUL_BF16 ({TK_MATMUL_BF16})"
                ));
            }
        };
        d.set_precision(p);
        Ok(())
    })
}

// ---- collectives (ABI 1.4) ---------------------------------------------------------

fn comm<'a>(comm: *mut TkComm) -> Result<&'a Comm> {
    let live = LIVE_COMMS.lock().unwrap_or_else(|e| e.into_inner());
    if comm.is_null() || !live.as_ref().is_some_and(|s| s.contains(&(comm as usize))) {
        return Err(invalid!("comm {comm:p} is not a live communicator of this library"));
    }
    // SAFETY: the address is in LIVE_COMMS, so it is a Box<Comm> we leaked in
    // tk_comm_create; the ABI destroys it only after every rank's last call returned.
    Ok(unsafe { &*(comm as *const Comm) })
}

/// # Safety
/// `out` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_comm_create(ranks: u32, out: *mut *mut TkComm) -> TkStatus {
    guard("tk_comm_create", || {
        check_out_ptr(out, "out")?;
        let p = Box::into_raw(Box::new(Comm::new(ranks as usize)?));
        LIVE_COMMS.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashSet::new).insert(p as usize);
        // SAFETY: out is non-null and, per the ABI, writable.
        unsafe { *out = p as *mut TkComm };
        Ok(())
    })
}

/// # Safety
/// No rank may be inside a call on `comm`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_comm_destroy(comm: *mut TkComm) {
    let _ = guard("tk_comm_destroy", || {
        let removed =
            LIVE_COMMS.lock().unwrap_or_else(|e| e.into_inner()).as_mut().is_some_and(|s| s.remove(&(comm as usize)));
        if removed {
            // SAFETY: the address was live (created by Box::into_raw) and is now
            // removed from the set, so it is dropped exactly once.
            drop(unsafe { Box::from_raw(comm as *mut Comm) });
        }
        Ok(())
    });
}

/// # Safety
/// Any thread, any time before `tk_comm_destroy`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_comm_abort(c: *mut TkComm) -> TkStatus {
    guard("tk_comm_abort", || {
        comm(c)?.abort("tk_comm_abort was called");
        Ok(())
    })
}

/// # Safety
/// Every handle and tensor argument is validated; `dev` is driven by this thread alone.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_all_reduce_sum_f32(
    c: *mut TkComm,
    rank: u32,
    dev: *mut TkDevice,
    buf: TkPtr,
    count: u64,
    timeout_ms: u32,
) -> TkStatus {
    let mut group = None;
    let status = guard("tk_all_reduce_sum_f32", || {
        let g = comm(c)?;
        group = Some(g);
        let d = device(dev)?;
        let count = usize::try_from(count).map_err(|_| invalid!("count {count} does not fit this host"))?;
        let b = arg(d, "buf", buf, count, 4, true)?;
        let timeout = std::time::Duration::from_millis(timeout_ms.into());
        // SAFETY: `b` is a checked, writable, aligned range of `count` f32 inside a live
        // buffer of `d`, which this thread alone drives during the call.
        unsafe { g.all_reduce_sum(rank as usize, b.addr, count, timeout) }
    });
    // A rank that fails (a bad argument, a panic) must not leave the others waiting.
    if status != TK_OK
        && let Some(g) = group
    {
        g.abort(&LAST_ERROR.with(|e| e.borrow().to_string_lossy().into_owned()));
    }
    status
}

// ---- memory ----------------------------------------------------------------------

/// # Safety
/// `out` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_alloc(dev: *mut TkDevice, bytes: u64, out: *mut *mut TkBuffer) -> TkStatus {
    guard("tk_alloc", || {
        let d = device(dev)?;
        check_out_ptr(out, "out")?;
        let id = d.alloc(bytes)?;
        // SAFETY: out is non-null and writable per the ABI.
        unsafe { *out = id as *mut TkBuffer };
        Ok(())
    })
}

/// # Safety
/// `host` must stay valid for `bytes` bytes until `tk_free`; `out` null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_buffer_wrap_host(
    dev: *mut TkDevice,
    host: *const c_void,
    bytes: u64,
    out: *mut *mut TkBuffer,
) -> TkStatus {
    guard("tk_buffer_wrap_host", || {
        let d = device(dev)?;
        check_out_ptr(out, "out")?;
        if host.is_null() {
            return Err(invalid!("host is null"));
        }
        let id = d.wrap_host(host as usize, bytes)?;
        // SAFETY: out is non-null and writable per the ABI.
        unsafe { *out = id as *mut TkBuffer };
        Ok(())
    })
}

/// # Safety
/// Every handle and tensor argument is validated; host pointers (none here
/// beyond the handles) follow the C ABI contract in `tessera_kernels.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_free(dev: *mut TkDevice, buf: *mut TkBuffer) -> TkStatus {
    guard("tk_free", || {
        let d = device(dev)?;
        if buf.is_null() {
            return Err(invalid!("buf is null"));
        }
        if !d.free(buf as usize) {
            return Err(invalid!("buf {buf:p} is not a live buffer of this device"));
        }
        Ok(())
    })
}

/// # Safety
/// `src` must be readable for `bytes` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_copy_h2d(dev: *mut TkDevice, dst: TkPtr, src: *const c_void, bytes: u64) -> TkStatus {
    guard("tk_copy_h2d", || {
        let d = device(dev)?;
        let n = usize::try_from(bytes).map_err(|_| invalid!("bytes = {bytes} is too large"))?;
        let a = arg(d, "dst", dst, n, 1, true)?;
        if n == 0 {
            return Ok(());
        }
        if src.is_null() {
            return Err(invalid!("src is null"));
        }
        // SAFETY: dst range validated; src readable per the caller contract; the host
        // memory is not one of our allocations' live slices (copy handles overlap).
        unsafe { std::ptr::copy(src as *const u8, a.addr as *mut u8, n) };
        Ok(())
    })
}

/// # Safety
/// `dst` must be writable for `bytes` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_copy_d2h(dev: *mut TkDevice, dst: *mut c_void, src: TkPtr, bytes: u64) -> TkStatus {
    guard("tk_copy_d2h", || {
        let d = device(dev)?;
        let n = usize::try_from(bytes).map_err(|_| invalid!("bytes = {bytes} is too large"))?;
        let a = arg(d, "src", src, n, 1, false)?;
        if n == 0 {
            return Ok(());
        }
        if dst.is_null() {
            return Err(invalid!("dst is null"));
        }
        // SAFETY: src range validated; dst writable per the caller contract.
        unsafe { std::ptr::copy(a.addr as *const u8, dst as *mut u8, n) };
        Ok(())
    })
}

/// # Safety
/// Every handle and tensor argument is validated; host pointers (none here
/// beyond the handles) follow the C ABI contract in `tessera_kernels.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_copy_d2d(dev: *mut TkDevice, dst: TkPtr, src: TkPtr, bytes: u64) -> TkStatus {
    guard("tk_copy_d2d", || {
        let d = device(dev)?;
        let n = usize::try_from(bytes).map_err(|_| invalid!("bytes = {bytes} is too large"))?;
        let s = arg(d, "src", src, n, 1, false)?;
        let t = arg(d, "dst", dst, n, 1, true)?;
        // SAFETY: both ranges validated; `copy` allows overlap.
        unsafe { std::ptr::copy(s.addr as *const u8, t.addr as *mut u8, n) };
        Ok(())
    })
}

// ---- ops ----------------------------------------------------------------------------

fn dims(name: &str, ds: &[u32]) -> Result<usize> {
    ds.iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d as usize))
        .ok_or_else(|| invalid!("{name}: element count {ds:?} overflows"))
}

/// # Safety
/// Every handle and tensor argument is validated; host pointers (none here
/// beyond the handles) follow the C ABI contract in `tessera_kernels.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_embedding(
    dev: *mut TkDevice,
    out: TkPtr,
    table: TkPtr,
    table_dtype: TkDtype,
    ids: TkPtr,
    n: u32,
    hidden: u32,
    vocab: u32,
) -> TkStatus {
    guard("tk_embedding", || {
        let d = device(dev)?;
        let wt = WType::from_abi(table_dtype, "table")?;
        let o = arg(d, "out", out, dims("out", &[n, hidden])?, 4, true)?;
        let t_bytes = wt.tensor_bytes("table", vocab as usize, hidden as usize)?;
        let t = arg(d, "table", table, t_bytes / wt.align(), wt.align(), false)?;
        let i = arg(d, "ids", ids, n as usize, 4, false)?;
        let t = wtinput(wt, &t, &[&o]);
        let i = input::<i32>(&i, &[&o]);
        // SAFETY: inputs overlapping `o` were copied above.
        let o = unsafe { output::<f32>(&o) };
        d.pool.install(|| ops::misc::embedding(o, t.view(), &i, n as usize, hidden as usize, vocab as usize))
    })
}

/// # Safety
/// Every handle and tensor argument is validated; host pointers (none here
/// beyond the handles) follow the C ABI contract in `tessera_kernels.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_linear(
    dev: *mut TkDevice,
    out: TkPtr,
    x: TkPtr,
    w: TkPtr,
    w_dtype: TkDtype,
    bias: TkPtr,
    m: u32,
    n: u32,
    k: u32,
) -> TkStatus {
    guard("tk_linear", || {
        let d = device(dev)?;
        let wt = WType::from_abi(w_dtype, "w")?;
        // A quantized weight's bias is f32 (ABI 1.2).
        let bias_dt = match wt {
            WType::Float(dt) => dt,
            WType::Quant(_) => DType::F32,
        };
        let o = arg(d, "out", out, dims("out", &[m, n])?, 4, true)?;
        let xa = arg(d, "x", x, dims("x", &[m, k])?, 4, false)?;
        let w_bytes = wt.tensor_bytes("w", n as usize, k as usize)?;
        let wa = arg(d, "w", w, w_bytes / wt.align(), wt.align(), false)?;
        let ba = if bias.buf.is_null() { None } else { Some(arg(d, "bias", bias, n as usize, bias_dt.size(), false)?) };
        let xs = input::<f32>(&xa, &[&o]);
        let ws = wtinput(wt, &wa, &[&o]);
        let bs = ba.map(|b| winput(bias_dt, &b, &[&o]));
        // SAFETY: inputs overlapping `o` were copied above.
        let o = unsafe { output::<f32>(&o) };
        d.pool.install(|| {
            let (m, n, k) = (m as usize, n as usize, k as usize);
            ops::linear::linear(o, &xs, ws.view(), bs.as_ref().map(|b| b.view()), m, n, k, d.precision())
        });
        Ok(())
    })
}

/// # Safety
/// Every handle and tensor argument is validated; host pointers (none here
/// beyond the handles) follow the C ABI contract in `tessera_kernels.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_rms_norm(
    dev: *mut TkDevice,
    out: TkPtr,
    x: TkPtr,
    weight: TkPtr,
    w_dtype: TkDtype,
    n: u32,
    hidden: u32,
    eps: f32,
) -> TkStatus {
    guard("tk_rms_norm", || {
        let d = device(dev)?;
        let dt = DType::from_abi(w_dtype, "weight")?;
        let o = arg(d, "out", out, dims("out", &[n, hidden])?, 4, true)?;
        let xa = arg(d, "x", x, dims("x", &[n, hidden])?, 4, false)?;
        let wa = arg(d, "weight", weight, hidden as usize, dt.size(), false)?;
        let xs = input::<f32>(&xa, &[&o]);
        let ws = winput(dt, &wa, &[&o]);
        // SAFETY: inputs overlapping `o` were copied above.
        let o = unsafe { output::<f32>(&o) };
        d.pool.install(|| ops::norm::rms_norm(o, &xs, ws.view(), n as usize, hidden as usize, eps));
        Ok(())
    })
}

/// # Safety
/// Every handle and tensor argument is validated; host pointers (none here
/// beyond the handles) follow the C ABI contract in `tessera_kernels.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_add_rms_norm(
    dev: *mut TkDevice,
    residual: TkPtr,
    x: TkPtr,
    weight: TkPtr,
    w_dtype: TkDtype,
    out: TkPtr,
    n: u32,
    hidden: u32,
    eps: f32,
) -> TkStatus {
    guard("tk_add_rms_norm", || {
        let d = device(dev)?;
        let dt = DType::from_abi(w_dtype, "weight")?;
        let cnt = dims("residual", &[n, hidden])?;
        let r = arg(d, "residual", residual, cnt, 4, true)?;
        let xa = arg(d, "x", x, cnt, 4, false)?;
        let wa = arg(d, "weight", weight, hidden as usize, dt.size(), false)?;
        let o = arg(d, "out", out, cnt, 4, true)?;
        check_disjoint(&[("out", &o, "residual", &r)])?;
        let xs = input::<f32>(&xa, &[&o, &r]);
        let ws = winput(dt, &wa, &[&o, &r]);
        // SAFETY: r and o are disjoint; inputs overlapping either were copied.
        let (r, o) = unsafe { (output::<f32>(&r), output::<f32>(&o)) };
        d.pool.install(|| ops::norm::add_rms_norm(r, &xs, ws.view(), o, n as usize, hidden as usize, eps));
        Ok(())
    })
}

/// # Safety
/// `rope` must be null or point to a valid `tk_rope`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_apply_rotary_pos_emb(
    dev: *mut TkDevice,
    q: TkPtr,
    k: TkPtr,
    positions: TkPtr,
    n: u32,
    num_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
    rope: *const TkRope,
) -> TkStatus {
    guard("tk_apply_rotary_pos_emb", || {
        let d = device(dev)?;
        let rope = *read_struct(rope, "rope")?;
        let qa = arg(d, "q", q, dims("q", &[n, num_heads, head_dim])?, 4, true)?;
        let ka = arg(d, "k", k, dims("k", &[n, num_kv_heads, head_dim])?, 4, true)?;
        let pa = arg(d, "positions", positions, n as usize, 4, false)?;
        check_disjoint(&[("q", &qa, "k", &ka)])?;
        let ps = input::<i32>(&pa, &[&qa, &ka]);
        // SAFETY: q and k are disjoint; positions was copied if it overlapped them.
        let (qs, ks) = unsafe { (output::<f32>(&qa), output::<f32>(&ka)) };
        d.pool.install(|| {
            ops::rope::apply_rotary_pos_emb(
                qs,
                ks,
                &ps,
                n as usize,
                num_heads as usize,
                num_kv_heads as usize,
                head_dim as usize,
                &rope,
            )
        })
    })
}

/// # Safety
/// Every handle and tensor argument is validated; host pointers (none here
/// beyond the handles) follow the C ABI contract in `tessera_kernels.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_silu_and_mul(
    dev: *mut TkDevice,
    out: TkPtr,
    gate: TkPtr,
    up: TkPtr,
    n: u32,
    inter: u32,
) -> TkStatus {
    guard("tk_silu_and_mul", || {
        let d = device(dev)?;
        let cnt = dims("out", &[n, inter])?;
        let o = arg(d, "out", out, cnt, 4, true)?;
        let g = arg(d, "gate", gate, cnt, 4, false)?;
        let u = arg(d, "up", up, cnt, 4, false)?;
        let gs = input::<f32>(&g, &[&o]);
        let us = input::<f32>(&u, &[&o]);
        // SAFETY: inputs overlapping `o` were copied above.
        let o = unsafe { output::<f32>(&o) };
        d.pool.install(|| ops::misc::silu_and_mul(o, &gs, &us));
        Ok(())
    })
}

/// Validates a cache descriptor and resolves its k and v tensors.
fn cache_args(d: &Device, c: &TkKvCache, write: bool) -> Result<(DType, KvGeom, Arg, Arg)> {
    let dt = DType::from_abi(c.dtype, "cache")?;
    let g = KvGeom {
        num_blocks: c.num_blocks as usize,
        block_size: c.block_size as usize,
        num_kv_heads: c.num_kv_heads as usize,
        head_dim: c.head_dim as usize,
        layout: KvLayout::from_abi(c.layout)?,
    };
    if g.block_size == 0 || g.num_kv_heads == 0 || g.head_dim == 0 {
        return Err(invalid!(
            "cache.block_size = {}, cache.num_kv_heads = {} and cache.head_dim = {} must be positive",
            g.block_size,
            g.num_kv_heads,
            g.head_dim
        ));
    }
    let cnt = g.elems().ok_or_else(|| invalid!("cache size overflows"))?;
    let k = arg(d, "cache.k", c.k, cnt, dt.size(), write)?;
    let v = arg(d, "cache.v", c.v, cnt, dt.size(), write)?;
    check_disjoint(&[("cache.k", &k, "cache.v", &v)])?;
    Ok((dt, g, k, v))
}

/// # Safety
/// `cache` must be null or point to a valid `tk_kv_cache`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_fill_kv_cache(
    dev: *mut TkDevice,
    cache: *const TkKvCache,
    k: TkPtr,
    v: TkPtr,
    slot_mapping: TkPtr,
    n: u32,
) -> TkStatus {
    guard("tk_fill_kv_cache", || {
        let d = device(dev)?;
        let c = *read_struct(cache, "cache")?;
        let (dt, g, kc, vc) = cache_args(d, &c, true)?;
        let cnt = dims("k", &[n, c.num_kv_heads, c.head_dim])?;
        let ka = arg(d, "k", k, cnt, 4, false)?;
        let va = arg(d, "v", v, cnt, 4, false)?;
        let sa = arg(d, "slot_mapping", slot_mapping, n as usize, 4, false)?;
        let ks = input::<f32>(&ka, &[&kc, &vc]);
        let vs = input::<f32>(&va, &[&kc, &vc]);
        let ss = input::<i32>(&sa, &[&kc, &vc]);
        // SAFETY: cache.k and cache.v are disjoint; overlapping inputs were copied.
        let (mut kw, mut vw) = unsafe { (woutput(dt, &kc), woutput(dt, &vc)) };
        ops::misc::fill_kv_cache(&mut kw, &mut vw, &g, &ks, &vs, &ss, n as usize)
    })
}

/// # Safety
/// `cache` and `batch` must be null or point to valid structs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_prefill_attention(
    dev: *mut TkDevice,
    out: TkPtr,
    q: TkPtr,
    cache: *const TkKvCache,
    batch: *const TkAttnBatch,
    total_q: u32,
    num_heads: u32,
    scale: f32,
) -> TkStatus {
    guard("tk_prefill_attention", || {
        let d = device(dev)?;
        let c = *read_struct(cache, "cache")?;
        let b = *read_struct(batch, "batch")?;
        let (dt, g, kc, vc) = cache_args(d, &c, false)?;
        let cnt = dims("q", &[total_q, num_heads, c.head_dim])?;
        let o = arg(d, "out", out, cnt, 4, true)?;
        let qa = arg(d, "q", q, cnt, 4, false)?;
        let ns = b.num_seqs as usize;
        let qsa = arg(d, "batch.query_start", b.query_start, ns + 1, 4, false)?;
        let cla = arg(d, "batch.context_lens", b.context_lens, ns, 4, false)?;
        let bta = arg(
            d,
            "batch.block_tables",
            b.block_tables,
            dims("batch.block_tables", &[b.num_seqs, b.max_blocks_per_seq])?,
            4,
            false,
        )?;
        let outs = [&o];
        let qs = input::<f32>(&qa, &outs);
        let kv = (winput(dt, &kc, &outs), winput(dt, &vc, &outs));
        let qst = input::<i32>(&qsa, &outs);
        let cl = input::<i32>(&cla, &outs);
        let bt = input::<i32>(&bta, &outs);
        // SAFETY: inputs overlapping `o` were copied above.
        let o = unsafe { output::<f32>(&o) };
        let view = KvView { k: kv.0.view(), v: kv.1.view(), geom: g };
        d.pool.install(|| {
            ops::attention::prefill_attention(
                o,
                &qs,
                &view,
                &qst,
                &cl,
                &bt,
                b.max_blocks_per_seq as usize,
                total_q as usize,
                num_heads as usize,
                scale,
            )
        })
    })
}

/// # Safety
/// `cache` must be null or point to a valid `tk_kv_cache`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_paged_decode_attention(
    dev: *mut TkDevice,
    out: TkPtr,
    q: TkPtr,
    cache: *const TkKvCache,
    block_tables: TkPtr,
    context_lens: TkPtr,
    num_seqs: u32,
    max_blocks_per_seq: u32,
    num_heads: u32,
    scale: f32,
) -> TkStatus {
    guard("tk_paged_decode_attention", || {
        let d = device(dev)?;
        let c = *read_struct(cache, "cache")?;
        let (dt, g, kc, vc) = cache_args(d, &c, false)?;
        let cnt = dims("q", &[num_seqs, num_heads, c.head_dim])?;
        let o = arg(d, "out", out, cnt, 4, true)?;
        let qa = arg(d, "q", q, cnt, 4, false)?;
        let bta =
            arg(d, "block_tables", block_tables, dims("block_tables", &[num_seqs, max_blocks_per_seq])?, 4, false)?;
        let cla = arg(d, "context_lens", context_lens, num_seqs as usize, 4, false)?;
        let outs = [&o];
        let qs = input::<f32>(&qa, &outs);
        let kv = (winput(dt, &kc, &outs), winput(dt, &vc, &outs));
        let bt = input::<i32>(&bta, &outs);
        let cl = input::<i32>(&cla, &outs);
        // SAFETY: inputs overlapping `o` were copied above.
        let o = unsafe { output::<f32>(&o) };
        let view = KvView { k: kv.0.view(), v: kv.1.view(), geom: g };
        d.pool.install(|| {
            ops::attention::paged_decode_attention(
                o,
                &qs,
                &view,
                &bt,
                &cl,
                num_seqs as usize,
                max_blocks_per_seq as usize,
                num_heads as usize,
                scale,
            )
        })
    })
}

/// # Safety
/// Every handle and tensor argument is validated; host pointers (none here
/// beyond the handles) follow the C ABI contract in `tessera_kernels.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_argmax(dev: *mut TkDevice, out: TkPtr, logits: TkPtr, n: u32, vocab: u32) -> TkStatus {
    guard("tk_argmax", || {
        let d = device(dev)?;
        let o = arg(d, "out", out, n as usize, 4, true)?;
        let l = arg(d, "logits", logits, dims("logits", &[n, vocab])?, 4, false)?;
        let ls = input::<f32>(&l, &[&o]);
        // SAFETY: logits was copied if it overlapped `o`.
        let o = unsafe { output::<i32>(&o) };
        d.pool.install(|| ops::misc::argmax(o, &ls, n as usize, vocab as usize));
        Ok(())
    })
}

/// # Safety
/// Every handle and tensor argument is validated; host pointers (none here
/// beyond the handles) follow the C ABI contract in `tessera_kernels.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tk_log_softmax(dev: *mut TkDevice, out: TkPtr, logits: TkPtr, n: u32, vocab: u32) -> TkStatus {
    guard("tk_log_softmax", || {
        let d = device(dev)?;
        let cnt = dims("out", &[n, vocab])?;
        let o = arg(d, "out", out, cnt, 4, true)?;
        let l = arg(d, "logits", logits, cnt, 4, false)?;
        if o.addr == l.addr {
            // SAFETY: out == logits: one exclusive slice, no aliasing.
            let x = unsafe { output::<f32>(&o) };
            d.pool.install(|| ops::misc::log_softmax_inplace(x, n as usize, vocab as usize));
        } else {
            let ls = input::<f32>(&l, &[&o]);
            // SAFETY: logits was copied if it overlapped `o`.
            let o = unsafe { output::<f32>(&o) };
            d.pool.install(|| ops::misc::log_softmax(o, &ls, n as usize, vocab as usize));
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn last() -> String {
        // SAFETY: tk_last_error returns a valid NUL-terminated thread-local string.
        unsafe { CStr::from_ptr(tk_last_error()) }.to_string_lossy().into_owned()
    }

    fn dev(threads: u32, limit: u64) -> *mut TkDevice {
        let cfg = TkDeviceConfig { threads, device_index: 0, memory_limit_bytes: limit };
        let mut d = std::ptr::null_mut();
        // SAFETY: valid pointers.
        assert_eq!(unsafe { tk_device_create(&cfg, &mut d) }, TK_OK);
        d
    }

    fn alloc(d: *mut TkDevice, bytes: u64) -> TkPtr {
        let mut b = std::ptr::null_mut();
        // SAFETY: valid pointers.
        assert_eq!(unsafe { tk_alloc(d, bytes, &mut b) }, TK_OK, "{}", last());
        TkPtr { buf: b, offset: 0 }
    }

    fn h2d<T>(d: *mut TkDevice, p: TkPtr, v: &[T]) {
        // SAFETY: v is readable for its byte size.
        let st = unsafe { tk_copy_h2d(d, p, v.as_ptr().cast(), size_of_val(v) as u64) };
        assert_eq!(st, TK_OK, "{}", last());
    }

    fn d2h<T: Default + Clone>(d: *mut TkDevice, p: TkPtr, n: usize) -> Vec<T> {
        let mut v = vec![T::default(); n];
        // SAFETY: v is writable for its byte size.
        let st = unsafe { tk_copy_d2h(d, v.as_mut_ptr().cast(), p, (n * size_of::<T>()) as u64) };
        assert_eq!(st, TK_OK, "{}", last());
        v
    }

    #[test]
    fn device_lifecycle_and_info() {
        // SAFETY: (whole test) all pointers passed are valid or deliberately bad
        // handles that the library must refuse without dereferencing.
        unsafe {
            assert_eq!(tk_abi_version(), (1 << 16) | 5);
            let cfg = TkDeviceConfig { threads: 5000, device_index: 0, memory_limit_bytes: 0 };
            let mut d = std::ptr::null_mut();
            assert_eq!(tk_device_create(&cfg, &mut d), TK_ERR_INVALID_ARGUMENT);
            assert!(last().contains("threads = 5000"), "{}", last());
            assert_eq!(tk_device_create(std::ptr::null(), &mut d), TK_ERR_INVALID_ARGUMENT);
            let d = dev(2, 1 << 20);
            let mut info = TkDeviceInfo::default();
            assert_eq!(tk_device_info_get(d, &mut info), TK_OK);
            let name = CStr::from_ptr(info.name.as_ptr()).to_str().unwrap();
            assert_eq!(name, format!("cpu (2 threads, {})", crate::simd::IsaLevel::in_use().name()));
            assert_eq!((info.memory_bytes, info.compute_units, info.host_memory_shared), (1 << 20, 2, 1));
            assert_eq!(tk_synchronize(d), TK_OK);
            // Matmul precision: f32 always; bf16 where the CPU has bf16 dot products.
            assert_eq!(tk_device_set_matmul_precision(d, TK_MATMUL_F32), TK_OK);
            assert_eq!(tk_device_set_matmul_precision(d, 7), TK_ERR_INVALID_ARGUMENT);
            assert!(last().contains("precision = 7"), "{}", last());
            if prefill_gemm::bf16_available() {
                assert_eq!(tk_device_set_matmul_precision(d, TK_MATMUL_BF16), TK_OK);
                assert_eq!((*(d as *const Device)).precision(), Precision::Bf16);
                assert_eq!(tk_device_set_matmul_precision(d, TK_MATMUL_F32), TK_OK);
            } else {
                assert_eq!(tk_device_set_matmul_precision(d, TK_MATMUL_BF16), TK_ERR_UNSUPPORTED);
                assert!(last().contains("AVX512-BF16"), "{}", last());
            }
            assert_eq!((*(d as *const Device)).precision(), Precision::F32);
            // Memory limit.
            let mut b = std::ptr::null_mut();
            assert_eq!(tk_alloc(d, 1 << 19, &mut b), TK_OK);
            let mut b2 = std::ptr::null_mut();
            assert_eq!(tk_alloc(d, (1 << 19) + 1, &mut b2), TK_ERR_OUT_OF_MEMORY);
            assert!(last().contains("requested 524289 bytes") && last().contains("1048576"), "{}", last());
            assert_eq!(tk_free(d, b), TK_OK);
            assert_eq!(tk_free(d, b), TK_ERR_INVALID_ARGUMENT);
            assert!(last().contains("not a live buffer"), "{}", last());
            assert_eq!(tk_alloc(d, (1 << 19) + 1, &mut b2), TK_OK);
            // A buffer of another device is refused.
            let d2 = dev(1, 0);
            assert_eq!(tk_free(d2, b2), TK_ERR_INVALID_ARGUMENT);
            tk_device_destroy(d2);
            tk_device_destroy(d);
            // Stale device.
            assert_eq!(tk_synchronize(d), TK_ERR_INVALID_ARGUMENT);
            assert!(last().contains("not a live device"), "{}", last());
            tk_device_destroy(d); // harmless
        }
    }

    #[test]
    fn alloc_is_zeroed_aligned_and_copies_are_checked() {
        let d = dev(1, 0);
        let p = alloc(d, 100);
        let v: Vec<u8> = d2h(d, p, 100);
        assert!(v.iter().all(|&b| b == 0));
        h2d(d, TkPtr { offset: 96, ..p }, &[1u8, 2, 3, 4]);
        // SAFETY: valid device; ranges deliberately out of bounds.
        unsafe {
            let x = [0u8; 8];
            let st = tk_copy_h2d(d, TkPtr { offset: 96, ..p }, x.as_ptr().cast(), 8);
            assert_eq!(st, TK_ERR_INVALID_ARGUMENT);
            assert!(last().contains("dst needs 8 bytes at offset 96 but buffer holds 100"), "{}", last());
            let q = alloc(d, 8);
            assert_eq!(tk_copy_d2d(d, q, TkPtr { offset: 96, ..p }, 4), TK_OK);
            assert_eq!(tk_copy_d2d(d, q, TkPtr { offset: 95, ..p }, 4), TK_OK);
            assert_eq!(tk_copy_d2d(d, q, TkPtr { offset: 95, ..p }, 8), TK_ERR_INVALID_ARGUMENT);
            let bogus = TkPtr { buf: 0x1234 as *mut TkBuffer, offset: 0 };
            assert_eq!(tk_copy_d2d(d, q, bogus, 4), TK_ERR_INVALID_ARGUMENT);
            assert!(last().contains("src buffer"), "{}", last());
            tk_device_destroy(d);
        }
    }

    #[test]
    fn ops_through_abi_and_argument_errors() {
        let d = dev(2, 0);
        let (m, n, k) = (2usize, 3usize, 4usize);
        let x: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.5).collect();
        let w: Vec<f32> = (0..n * k).map(|i| 1.0 - i as f32 * 0.1).collect();
        let xp = alloc(d, (m * k * 4) as u64);
        let op = alloc(d, (m * n * 4) as u64);
        h2d(d, xp, &x);
        // Weights wrapped read-only, zero-copy.
        let mut wb = std::ptr::null_mut();
        // SAFETY: (whole block) w outlives its buffer handle; other pointers are
        // valid or deliberately bad handles.
        unsafe {
            assert_eq!(tk_buffer_wrap_host(d, w.as_ptr().cast(), (n * k * 4) as u64, &mut wb), TK_OK);
            let wp = TkPtr { buf: wb, offset: 0 };
            let st = tk_linear(d, op, xp, wp, TK_DTYPE_F32, TkPtr::NULL, m as u32, n as u32, k as u32);
            assert_eq!(st, TK_OK, "{}", last());
            let out: Vec<f32> = d2h(d, op, m * n);
            for i in 0..m {
                for j in 0..n {
                    let want: f32 = (0..k).map(|kk| x[i * k + kk] * w[j * k + kk]).sum();
                    assert!((out[i * n + j] - want).abs() < 1e-5);
                }
            }
            // Read-only output.
            let st = tk_linear(d, wp, xp, wp, TK_DTYPE_F32, TkPtr::NULL, 1, 1, 1);
            assert_eq!(st, TK_ERR_INVALID_ARGUMENT);
            assert!(last().starts_with("tk_linear: out is a read-only"), "{}", last());
            // Too small weight buffer.
            let st = tk_linear(d, op, xp, wp, TK_DTYPE_F32, TkPtr::NULL, 1, 4, k as u32);
            assert_eq!(st, TK_ERR_INVALID_ARGUMENT);
            assert!(last().contains("tk_linear: w needs 64 bytes at offset 0 but buffer holds 48"), "{}", last());
            // Bad dtype.
            let st = tk_linear(d, op, xp, wp, 77, TkPtr::NULL, 1, 1, 1);
            assert_eq!(st, TK_ERR_INVALID_ARGUMENT);
            assert!(last().contains("unknown dtype 77"), "{}", last());
            let st = tk_linear(d, op, xp, wp, TK_DTYPE_I32, TkPtr::NULL, 1, 1, 1);
            assert_eq!(st, TK_ERR_UNSUPPORTED);
            // Misaligned offset.
            let st = tk_linear(d, op, TkPtr { offset: 2, ..xp }, wp, TK_DTYPE_F32, TkPtr::NULL, 1, 1, 1);
            assert_eq!(st, TK_ERR_INVALID_ARGUMENT);
            assert!(last().contains("not aligned"), "{}", last());
            // Null and bogus handles.
            let st = tk_linear(d, TkPtr::NULL, xp, wp, TK_DTYPE_F32, TkPtr::NULL, 1, 1, 1);
            assert_eq!(st, TK_ERR_INVALID_ARGUMENT);
            assert!(last().contains("out is a null buffer"), "{}", last());
            let bogus = TkPtr { buf: 0xdead0 as *mut TkBuffer, offset: 0 };
            let st = tk_linear(d, op, bogus, wp, TK_DTYPE_F32, TkPtr::NULL, 1, 1, 1);
            assert_eq!(st, TK_ERR_INVALID_ARGUMENT);
            let st = tk_linear(std::ptr::null_mut(), op, xp, wp, TK_DTYPE_F32, TkPtr::NULL, 1, 1, 1);
            assert_eq!(st, TK_ERR_INVALID_ARGUMENT);

            // log_softmax in place and argmax.
            let lp = alloc(d, 16);
            h2d(d, lp, &[1.0f32, 3.0, 3.0, 2.0]);
            let ap = alloc(d, 4);
            assert_eq!(tk_argmax(d, ap, lp, 1, 4), TK_OK);
            assert_eq!(d2h::<i32>(d, ap, 1), vec![1]);
            assert_eq!(tk_log_softmax(d, lp, lp, 1, 4), TK_OK);
            let ls: Vec<f32> = d2h(d, lp, 4);
            let sum: f32 = ls.iter().map(|v| v.exp()).sum();
            assert!((sum - 1.0).abs() < 1e-5 && (ls[1] - ls[0] - 2.0).abs() < 1e-5);
            // Partially overlapping out / logits.
            let big = alloc(d, 32);
            h2d(d, big, &[0.0f32, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0]);
            assert_eq!(tk_log_softmax(d, TkPtr { offset: 8, ..big }, big, 1, 4), TK_OK);

            // Embedding with an out-of-range id.
            let ids = alloc(d, 4);
            h2d(d, ids, &[5i32]);
            let st = tk_embedding(d, op, xp, TK_DTYPE_F32, ids, 1, 2, 4);
            assert_eq!(st, TK_ERR_INVALID_ARGUMENT);
            assert!(last().contains("tk_embedding: ids[0] = 5"), "{}", last());

            // fill_kv_cache: slot out of range; cache k/v overlapping; wrapped cache.
            let kc = alloc(d, 2 * 4 * 4 * 4);
            let cache = TkKvCache {
                k: kc,
                v: TkPtr { offset: 64, ..kc },
                dtype: TK_DTYPE_F32,
                num_blocks: 2,
                block_size: 2,
                num_kv_heads: 1,
                head_dim: 4,
                layout: TK_KV_LAYOUT_HEAD_MAJOR,
            };
            let sl = alloc(d, 4);
            h2d(d, sl, &[4i32]);
            // An unknown layout is refused before anything is written.
            let odd = TkKvCache { layout: 2, ..cache };
            assert_eq!(tk_fill_kv_cache(d, &odd, xp, xp, sl, 1), TK_ERR_INVALID_ARGUMENT);
            assert!(last().contains("tk_fill_kv_cache: cache.layout = 2 is unknown"), "{}", last());
            let st = tk_fill_kv_cache(d, &cache, xp, xp, sl, 1);
            assert_eq!(st, TK_ERR_INVALID_ARGUMENT);
            assert!(last().contains("slot_mapping[0] = 4"), "{}", last());
            let bad = TkKvCache { v: TkPtr { offset: 32, ..kc }, ..cache };
            assert_eq!(tk_fill_kv_cache(d, &bad, xp, xp, sl, 1), TK_ERR_INVALID_ARGUMENT);
            assert!(last().contains("overlap"), "{}", last());
            h2d(d, sl, &[3i32]);
            assert_eq!(tk_fill_kv_cache(d, &cache, xp, xp, sl, 1), TK_OK, "{}", last());
            let ro = TkKvCache { k: TkPtr { buf: wb, offset: 0 }, num_blocks: 1, ..cache };
            assert_eq!(tk_fill_kv_cache(d, &ro, xp, xp, sl, 1), TK_ERR_INVALID_ARGUMENT);
            assert!(last().contains("cache.k is a read-only"), "{}", last());
            assert_eq!(tk_fill_kv_cache(d, std::ptr::null(), xp, xp, sl, 1), TK_ERR_INVALID_ARGUMENT);

            // Decode attention over that slot with a bad block table entry.
            let bt = alloc(d, 8);
            h2d(d, bt, &[0i32, 9]);
            let cl = alloc(d, 4);
            h2d(d, cl, &[4i32]);
            let st = tk_paged_decode_attention(d, op, xp, &cache, bt, cl, 1, 2, 1, 0.5);
            assert_eq!(st, TK_ERR_INVALID_ARGUMENT);
            assert!(last().contains("block_tables[0][1] = 9"), "{}", last());
            h2d(d, bt, &[0i32, 1]);
            let st = tk_paged_decode_attention(d, op, xp, &cache, bt, cl, 1, 2, 1, 0.5);
            assert_eq!(st, TK_OK, "{}", last());
            // Prefill with inconsistent query_start.
            let qs = alloc(d, 8);
            h2d(d, qs, &[0i32, 1]);
            let batch =
                TkAttnBatch { num_seqs: 1, max_blocks_per_seq: 2, query_start: qs, context_lens: cl, block_tables: bt };
            let st = tk_prefill_attention(d, op, xp, &cache, &batch, 0, 1, 0.5);
            assert_eq!(st, TK_ERR_INVALID_ARGUMENT);
            assert!(last().contains("exceeds total_q"), "{}", last());
            assert_eq!(tk_prefill_attention(d, op, xp, &cache, &batch, 1, 1, 0.5), TK_OK, "{}", last());

            // Rope with a null descriptor and with q/k overlapping.
            let pos = alloc(d, 8);
            let st = tk_apply_rotary_pos_emb(d, xp, xp, pos, 1, 1, 1, 4, std::ptr::null());
            assert_eq!(st, TK_ERR_INVALID_ARGUMENT);
            let rope = TkRope { theta: 10000.0, ..Default::default() };
            let st = tk_apply_rotary_pos_emb(d, xp, xp, pos, 1, 1, 1, 4, &rope);
            assert_eq!(st, TK_ERR_INVALID_ARGUMENT);
            assert!(last().contains("q and k overlap"), "{}", last());
            let st = tk_apply_rotary_pos_emb(d, xp, TkPtr { offset: 16, ..xp }, pos, 1, 1, 1, 4, &rope);
            assert_eq!(st, TK_OK, "{}", last());

            // add_rms_norm aliasing out/residual refused; silu with out == gate fine.
            let wn = alloc(d, 16);
            let st = tk_add_rms_norm(d, xp, op, wn, TK_DTYPE_F32, xp, 1, 4, 1e-5);
            assert_eq!(st, TK_ERR_INVALID_ARGUMENT);
            assert!(last().contains("out and residual overlap"), "{}", last());
            assert_eq!(tk_add_rms_norm(d, xp, xp, wn, TK_DTYPE_F32, op, 1, 4, 1e-5), TK_OK);
            assert_eq!(tk_rms_norm(d, op, xp, wn, TK_DTYPE_BF16, 1, 4, 1e-5), TK_OK);
            assert_eq!(tk_silu_and_mul(d, xp, xp, op, 1, 4), TK_OK);

            assert_eq!(tk_free(d, wb), TK_OK);
            tk_device_destroy(d);
        }
    }
}
