//! The Tessera kernel ABI as Rust types: a line-for-line mirror of
//! `backends/include/tessera_kernels.h`, shared by the loader (which calls a library)
//! and by kernel libraries written in Rust (which implement it). It depends on nothing
//! and holds no code that runs: only `#[repr(C)]` types, constants and the function
//! pointer signature of every exported symbol.
#![forbid(unsafe_code)]

use std::ffi::c_char;
use std::ffi::c_void;

pub const TK_ABI_MAJOR: u32 = 1;
/// 1.1 added `TkKvCache::layout` (token-major KV blocks); 1.2 quantized weight dtypes;
/// 1.3 the optional `tk_device_set_matmul_precision`; 1.4 the optional collectives
/// (`tk_comm_*`, `tk_all_reduce_sum_f32`); 1.5 `TK_DTYPE_Q5_K`.
pub const TK_ABI_MINOR: u32 = 5;
/// The oldest minor a loader accepts: 1.1 libraries still serve float weights.
pub const TK_ABI_MINOR_OLDEST: u32 = 1;
/// The minor that added the quantized weight dtypes (`TK_DTYPE_Q*`).
pub const TK_ABI_MINOR_QUANT: u32 = 2;

/// The minor that added the optional collectives.
pub const TK_ABI_MINOR_COLLECTIVES: u32 = 4;

/// The minor that added `TK_DTYPE_Q5_K`.
pub const TK_ABI_MINOR_Q5_K: u32 = 5;

/// `(MAJOR << 16) | MINOR`, what `tk_abi_version` returns.
pub const fn abi_version(major: u32, minor: u32) -> u32 {
    (major << 16) | minor
}

pub type TkStatus = i32;
pub const TK_OK: TkStatus = 0;
pub const TK_ERR_INVALID_ARGUMENT: TkStatus = 1;
pub const TK_ERR_OUT_OF_MEMORY: TkStatus = 2;
pub const TK_ERR_UNSUPPORTED: TkStatus = 3;
pub const TK_ERR_INTERNAL: TkStatus = 4;

pub type TkDtype = i32;
pub const TK_DTYPE_F32: TkDtype = 0;
pub const TK_DTYPE_F16: TkDtype = 1;
pub const TK_DTYPE_BF16: TkDtype = 2;
pub const TK_DTYPE_I32: TkDtype = 3;
/// Quantized weights (since 1.2): rows of ggml blocks, byte for byte as `ggml-common.h`.
pub const TK_DTYPE_Q4_0: TkDtype = 16;
pub const TK_DTYPE_Q4_1: TkDtype = 17;
pub const TK_DTYPE_Q5_0: TkDtype = 18;
pub const TK_DTYPE_Q5_1: TkDtype = 19;
pub const TK_DTYPE_Q8_0: TkDtype = 20;
pub const TK_DTYPE_Q4_K: TkDtype = 21;
pub const TK_DTYPE_Q6_K: TkDtype = 22;
/// Since 1.5.
pub const TK_DTYPE_Q5_K: TkDtype = 23;

/// `tk_device_set_matmul_precision`'s values (since 1.3).
pub const TK_MATMUL_F32: u32 = 0;
pub const TK_MATMUL_BF16: u32 = 1;

pub const TK_ROPE_NONE: u32 = 0;
pub const TK_ROPE_LLAMA3: u32 = 1;
pub const TK_ROPE_LINEAR: u32 = 2;

/// Block = `[num_kv_heads][block_size][head_dim]`.
pub const TK_KV_LAYOUT_HEAD_MAJOR: u32 = 0;
/// Block = `[block_size][num_kv_heads][head_dim]` (since ABI 1.1).
pub const TK_KV_LAYOUT_TOKEN_MAJOR: u32 = 1;

/// Opaque device handle (`tk_device`).
#[repr(C)]
pub struct TkDevice {
    _private: [u8; 0],
}

/// Opaque buffer handle (`tk_buffer`).
#[repr(C)]
pub struct TkBuffer {
    _private: [u8; 0],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct TkDeviceConfig {
    pub threads: u32,
    pub device_index: u32,
    pub memory_limit_bytes: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct TkDeviceInfo {
    pub name: [c_char; 64],
    pub memory_bytes: u64,
    pub compute_units: u32,
    pub host_memory_shared: u32,
}

impl Default for TkDeviceInfo {
    fn default() -> Self {
        TkDeviceInfo { name: [0; 64], memory_bytes: 0, compute_units: 0, host_memory_shared: 0 }
    }
}

/// Opaque communicator handle (`tk_comm`, since 1.4): the ranks of one group.
#[repr(C)]
pub struct TkComm {
    _private: [u8; 0],
}

/// A tensor argument: buffer + byte offset. A null `buf` means "absent".
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct TkPtr {
    pub buf: *mut TkBuffer,
    pub offset: u64,
}

impl TkPtr {
    pub const NULL: TkPtr = TkPtr { buf: std::ptr::null_mut(), offset: 0 };
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TkRope {
    pub theta: f32,
    pub scaling: u32,
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct TkKvCache {
    pub k: TkPtr,
    pub v: TkPtr,
    pub dtype: TkDtype,
    pub num_blocks: u32,
    pub block_size: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    /// `TK_KV_LAYOUT_*` (since ABI 1.1).
    pub layout: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct TkAttnBatch {
    pub num_seqs: u32,
    pub max_blocks_per_seq: u32,
    pub query_start: TkPtr,
    pub context_lens: TkPtr,
    pub block_tables: TkPtr,
}

pub type AbiVersionFn = unsafe extern "C" fn() -> u32;
pub type LastErrorFn = unsafe extern "C" fn() -> *const c_char;
pub type DeviceCreateFn = unsafe extern "C" fn(config: *const TkDeviceConfig, out: *mut *mut TkDevice) -> TkStatus;
pub type DeviceDestroyFn = unsafe extern "C" fn(dev: *mut TkDevice);
/// Optional (since 1.3).
pub type DeviceSetMatmulPrecisionFn = unsafe extern "C" fn(dev: *mut TkDevice, precision: u32) -> TkStatus;
/// Optional (since 1.4), all four or none.
pub type CommCreateFn = unsafe extern "C" fn(ranks: u32, out: *mut *mut TkComm) -> TkStatus;
pub type CommDestroyFn = unsafe extern "C" fn(comm: *mut TkComm);
pub type CommAbortFn = unsafe extern "C" fn(comm: *mut TkComm) -> TkStatus;
pub type AllReduceSumF32Fn = unsafe extern "C" fn(
    comm: *mut TkComm,
    rank: u32,
    dev: *mut TkDevice,
    buf: TkPtr,
    count: u64,
    timeout_ms: u32,
) -> TkStatus;
pub type DeviceInfoGetFn = unsafe extern "C" fn(dev: *mut TkDevice, out: *mut TkDeviceInfo) -> TkStatus;
pub type SynchronizeFn = unsafe extern "C" fn(dev: *mut TkDevice) -> TkStatus;
pub type AllocFn = unsafe extern "C" fn(dev: *mut TkDevice, bytes: u64, out: *mut *mut TkBuffer) -> TkStatus;
pub type BufferWrapHostFn =
    unsafe extern "C" fn(dev: *mut TkDevice, host: *const c_void, bytes: u64, out: *mut *mut TkBuffer) -> TkStatus;
pub type FreeFn = unsafe extern "C" fn(dev: *mut TkDevice, buf: *mut TkBuffer) -> TkStatus;
pub type CopyH2dFn = unsafe extern "C" fn(dev: *mut TkDevice, dst: TkPtr, src: *const c_void, bytes: u64) -> TkStatus;
pub type CopyD2hFn = unsafe extern "C" fn(dev: *mut TkDevice, dst: *mut c_void, src: TkPtr, bytes: u64) -> TkStatus;
pub type CopyD2dFn = unsafe extern "C" fn(dev: *mut TkDevice, dst: TkPtr, src: TkPtr, bytes: u64) -> TkStatus;
pub type EmbeddingFn = unsafe extern "C" fn(
    dev: *mut TkDevice,
    out: TkPtr,
    table: TkPtr,
    table_dtype: TkDtype,
    ids: TkPtr,
    n: u32,
    hidden: u32,
    vocab: u32,
) -> TkStatus;
pub type LinearFn = unsafe extern "C" fn(
    dev: *mut TkDevice,
    out: TkPtr,
    x: TkPtr,
    w: TkPtr,
    w_dtype: TkDtype,
    bias: TkPtr,
    m: u32,
    n: u32,
    k: u32,
) -> TkStatus;
pub type RmsNormFn = unsafe extern "C" fn(
    dev: *mut TkDevice,
    out: TkPtr,
    x: TkPtr,
    weight: TkPtr,
    w_dtype: TkDtype,
    n: u32,
    hidden: u32,
    eps: f32,
) -> TkStatus;
pub type AddRmsNormFn = unsafe extern "C" fn(
    dev: *mut TkDevice,
    residual: TkPtr,
    x: TkPtr,
    weight: TkPtr,
    w_dtype: TkDtype,
    out: TkPtr,
    n: u32,
    hidden: u32,
    eps: f32,
) -> TkStatus;
pub type ApplyRotaryPosEmbFn = unsafe extern "C" fn(
    dev: *mut TkDevice,
    q: TkPtr,
    k: TkPtr,
    positions: TkPtr,
    n: u32,
    num_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
    rope: *const TkRope,
) -> TkStatus;
pub type SiluAndMulFn =
    unsafe extern "C" fn(dev: *mut TkDevice, out: TkPtr, gate: TkPtr, up: TkPtr, n: u32, inter: u32) -> TkStatus;
pub type FillKvCacheFn = unsafe extern "C" fn(
    dev: *mut TkDevice,
    cache: *const TkKvCache,
    k: TkPtr,
    v: TkPtr,
    slot_mapping: TkPtr,
    n: u32,
) -> TkStatus;
pub type PrefillAttentionFn = unsafe extern "C" fn(
    dev: *mut TkDevice,
    out: TkPtr,
    q: TkPtr,
    cache: *const TkKvCache,
    batch: *const TkAttnBatch,
    total_q: u32,
    num_heads: u32,
    scale: f32,
) -> TkStatus;
pub type PagedDecodeAttentionFn = unsafe extern "C" fn(
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
) -> TkStatus;
pub type ArgmaxFn = unsafe extern "C" fn(dev: *mut TkDevice, out: TkPtr, logits: TkPtr, n: u32, vocab: u32) -> TkStatus;
pub type LogSoftmaxFn =
    unsafe extern "C" fn(dev: *mut TkDevice, out: TkPtr, logits: TkPtr, n: u32, vocab: u32) -> TkStatus;

/// Every symbol a kernel library must export, in the order the loader resolves them
/// (after `tk_abi_version`, which is checked first).
pub const REQUIRED_SYMBOLS: &[&str] = &[
    "tk_last_error",
    "tk_device_create",
    "tk_device_destroy",
    "tk_device_info_get",
    "tk_synchronize",
    "tk_alloc",
    "tk_buffer_wrap_host",
    "tk_free",
    "tk_copy_h2d",
    "tk_copy_d2h",
    "tk_copy_d2d",
    "tk_embedding",
    "tk_linear",
    "tk_rms_norm",
    "tk_add_rms_norm",
    "tk_apply_rotary_pos_emb",
    "tk_silu_and_mul",
    "tk_fill_kv_cache",
    "tk_prefill_attention",
    "tk_paged_decode_attention",
    "tk_argmax",
    "tk_log_softmax",
];

/// The collectives (since 1.4): a library exports all of them or none.
pub const COLLECTIVE_SYMBOLS: &[&str] =
    &["tk_comm_create", "tk_comm_destroy", "tk_comm_abort", "tk_all_reduce_sum_f32"];
