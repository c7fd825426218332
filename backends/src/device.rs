//! The safe face of a kernel library: a `Device` owning device memory (`Buffer`s) and
//! exposing every ABI op with typed arguments. Errors carry the op, the device and the
//! library's own message.

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;

use tessera_kernel_abi as abi;

use crate::dtype::{DType, DTypeExt, GgmlTypeExt, WeightType};
use crate::error::{BackendError, Result};
use crate::kv_format::{KvLayout, KvLayoutExt};
use crate::loader::{KernelLibrary, RawBuffer, RawComm, RawDevice, raw};

pub use tessera_vocab::MatmulPrecision;

/// How to open a device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Worker threads; 0 = all cores.
    pub threads: u32,
    /// Index of the physical device for multi-device libraries.
    pub device_index: u32,
    /// Cap on device memory; 0 = what the device has.
    pub memory_limit_bytes: u64,
    /// The arithmetic of prompts' linear layers (ABI 1.3).
    pub matmul_precision: MatmulPrecision,
}

/// What the device says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub name: String,
    pub memory_bytes: u64,
    pub compute_units: u32,
    /// Wrapping host memory (e.g. mmapped weights) costs no copy.
    pub host_memory_shared: bool,
}

/// One opened device of a kernel library. `!Sync`: ops are issued from one thread.
pub struct Device {
    raw: Arc<RawDevice>,
    info: DeviceInfo,
    matmul_precision: MatmulPrecision,
    _not_sync: PhantomData<std::cell::Cell<()>>,
}

/// A communicator of a kernel library's collectives (ABI 1.4): the ranks of one
/// tensor-parallel group, each a device of that library on a thread of its own.
/// Destroyed when its last owner drops it (after every rank's last call).
pub struct Communicator {
    raw: RawComm,
    ranks: usize,
}

impl Communicator {
    /// A communicator of `ranks` ranks, if `lib` has collectives.
    pub fn new(lib: &Arc<KernelLibrary>, ranks: usize) -> Result<Communicator> {
        let ptr = raw::comm_create(lib, ranks as u32).map_err(|(status, message)| BackendError::KernelLibrary {
            library: lib.path().to_path_buf(),
            reason: format!("tk_comm_create({ranks}) failed ({}): {message}", status_name(status)),
        })?;
        Ok(Communicator { raw: RawComm { lib: lib.clone(), ptr }, ranks })
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Ends every rank's wait, now and later.
    pub fn abort(&self) {
        // A failed abort leaves the ranks to their timeout; there is nothing else to do.
        let _ = raw::comm_abort(&self.raw.lib, self.raw.ptr);
    }
}

/// A region of device memory. Freed on drop.
pub struct Buffer {
    raw: RawBuffer,
    bytes: usize,
}

/// A tensor argument: a buffer and a byte offset into it.
#[derive(Clone, Copy)]
pub struct View<'a> {
    buf: &'a Buffer,
    offset: usize,
}

impl Buffer {
    pub fn len_bytes(&self) -> usize {
        self.bytes
    }

    /// The whole buffer from its start.
    pub fn view(&self) -> View<'_> {
        View { buf: self, offset: 0 }
    }

    /// The buffer from `offset` bytes on.
    pub fn at(&self, offset: usize) -> View<'_> {
        View { buf: self, offset }
    }
}

impl<'a> View<'a> {
    /// The same buffer, `bytes` further on.
    pub fn offset_by(self, bytes: usize) -> View<'a> {
        View { buf: self.buf, offset: self.offset + bytes }
    }

    fn abi(&self) -> abi::TkPtr {
        abi::TkPtr { buf: self.buf.raw.ptr, offset: self.offset as u64 }
    }
}

fn status_name(status: abi::TkStatus) -> &'static str {
    match status {
        abi::TK_ERR_INVALID_ARGUMENT => "invalid argument",
        abi::TK_ERR_OUT_OF_MEMORY => "out of memory",
        abi::TK_ERR_UNSUPPORTED => "unsupported",
        abi::TK_ERR_INTERNAL => "internal error",
        _ => "unknown status",
    }
}

/// The paged KV cache of one layer, as the kernels see it.
#[derive(Clone, Copy)]
pub struct KvCacheView<'a> {
    pub k: View<'a>,
    pub v: View<'a>,
    pub dtype: DType,
    pub num_blocks: u32,
    pub block_size: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub layout: KvLayout,
}

impl KvCacheView<'_> {
    fn abi(&self) -> abi::TkKvCache {
        abi::TkKvCache {
            k: self.k.abi(),
            v: self.v.abi(),
            dtype: self.dtype.to_abi(),
            num_blocks: self.num_blocks,
            block_size: self.block_size,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            layout: self.layout.to_abi(),
        }
    }
}

/// Sequence layout of a packed attention batch (see `tk_attn_batch`).
#[derive(Clone, Copy)]
pub struct AttnBatchView<'a> {
    pub num_seqs: u32,
    pub max_blocks_per_seq: u32,
    pub query_start: View<'a>,
    pub context_lens: View<'a>,
    pub block_tables: View<'a>,
}

impl Device {
    /// Opens a device of `lib`; a library whose init fails is refused with its message.
    /// Open it on the thread that will issue its ops: the CPU library makes that thread
    /// one of the device's workers, so ops run without a cross-thread hand-off.
    pub fn open(lib: &Arc<KernelLibrary>, config: &DeviceConfig) -> Result<Device> {
        let cfg = abi::TkDeviceConfig {
            threads: config.threads,
            device_index: config.device_index,
            memory_limit_bytes: config.memory_limit_bytes,
        };
        let ptr = raw::device_create(lib, &cfg).map_err(|(status, message)| BackendError::KernelLibrary {
            library: lib.path().to_path_buf(),
            reason: format!("tk_device_create failed ({}): {message}", status_name(status)),
        })?;
        let raw = Arc::new(RawDevice { lib: lib.clone(), ptr });
        if config.matmul_precision != MatmulPrecision::F32 {
            let precision = match config.matmul_precision {
                MatmulPrecision::F32 => abi::TK_MATMUL_F32,
                MatmulPrecision::Bf16 => abi::TK_MATMUL_BF16,
            };
            raw::set_matmul_precision(lib, ptr, precision).map_err(|(status, message)| {
                BackendError::KernelLibrary {
                    library: lib.path().to_path_buf(),
                    reason: format!(
                        "matmul precision {}: {} ({message})",
                        config.matmul_precision,
                        status_name(status)
                    ),
                }
            })?;
        }
        let (status, info) = raw::device_info(lib, ptr);
        if status != abi::TK_OK {
            return Err(BackendError::KernelLibrary {
                library: lib.path().to_path_buf(),
                reason: format!("tk_device_info_get failed: {}", lib.last_error()),
            });
        }
        let name_bytes: Vec<u8> = info.name.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        let info = DeviceInfo {
            name: String::from_utf8_lossy(&name_bytes).into_owned(),
            memory_bytes: info.memory_bytes,
            compute_units: info.compute_units,
            host_memory_shared: info.host_memory_shared != 0,
        };
        Ok(Device { raw, info, matmul_precision: config.matmul_precision, _not_sync: PhantomData })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The arithmetic of prompts' linear layers the device was opened with.
    pub fn matmul_precision(&self) -> MatmulPrecision {
        self.matmul_precision
    }

    pub fn library(&self) -> &Arc<KernelLibrary> {
        &self.raw.lib
    }

    /// A tensor argument, refused unless its buffer belongs to this device (a handle of
    /// another device, even of the same library, must never reach a kernel).
    fn arg(&self, v: View<'_>) -> Result<abi::TkPtr> {
        if !Arc::ptr_eq(&v.buf.raw.dev, &self.raw) {
            return Err(BackendError::Request(format!(
                "a buffer of another device was passed to device {}",
                self.info.name
            )));
        }
        Ok(v.abi())
    }

    /// This device's part, as rank `rank` of `comm`, of summing `len` f32 at `buf` over
    /// every rank (ABI 1.4's `tk_all_reduce_sum_f32`).
    pub fn all_reduce_sum(
        &self,
        comm: &Communicator,
        rank: usize,
        buf: View<'_>,
        len: usize,
        timeout: std::time::Duration,
    ) -> Result<()> {
        if !Arc::ptr_eq(&comm.raw.lib, &self.raw.lib) {
            return Err(BackendError::Request(format!(
                "device {} is not of the library of its communicator ({})",
                self.info.name,
                comm.raw.lib.path().display()
            )));
        }
        let timeout_ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        let status = raw::all_reduce_sum_f32(
            &self.raw.lib,
            comm.raw.ptr,
            rank as u32,
            self.raw.ptr,
            self.arg(buf)?,
            len as u64,
            timeout_ms,
        );
        self.check("tk_all_reduce_sum_f32", status)
    }

    fn opt_arg(&self, v: Option<View<'_>>) -> Result<abi::TkPtr> {
        v.map_or(Ok(abi::TkPtr::NULL), |v| self.arg(v))
    }

    fn kv_arg(&self, cache: &KvCacheView<'_>) -> Result<abi::TkKvCache> {
        self.arg(cache.k)?;
        self.arg(cache.v)?;
        Ok(cache.abi())
    }

    fn check(&self, op: &'static str, status: abi::TkStatus) -> Result<()> {
        if status == abi::TK_OK {
            return Ok(());
        }
        Err(BackendError::Kernel {
            op,
            device: self.info.name.clone(),
            status: status_name(status),
            message: self.raw.lib.last_error(),
        })
    }

    fn buffer(
        &self,
        op: &'static str,
        status: abi::TkStatus,
        ptr: *mut abi::TkBuffer,
        bytes: usize,
        owner: Option<Arc<dyn std::any::Any + Send + Sync>>,
    ) -> Result<Buffer> {
        self.check(op, status)?;
        if ptr.is_null() {
            return Err(BackendError::Kernel {
                op,
                device: self.info.name.clone(),
                status: "internal error",
                message: "returned a null buffer".into(),
            });
        }
        Ok(Buffer { raw: RawBuffer { dev: self.raw.clone(), ptr, _owner: owner }, bytes })
    }

    /// Allocates `bytes` of zeroed device memory.
    pub fn alloc(&self, bytes: usize) -> Result<Buffer> {
        let (status, ptr) = raw::alloc(&self.raw.lib, self.raw.ptr, bytes as u64);
        self.buffer("tk_alloc", status, ptr, bytes, None)
    }

    /// Makes `owner[range]` a read-only device buffer without copying where the device
    /// shares host memory. `owner` (e.g. a memory map) is kept alive by the buffer.
    pub fn wrap_host<O>(&self, owner: Arc<O>, range: Range<usize>) -> Result<Buffer>
    where
        O: AsRef<[u8]> + Send + Sync + 'static,
    {
        let bytes = owner.as_ref().as_ref().get(range.clone()).ok_or_else(|| {
            BackendError::Request(format!(
                "host range {range:?} is outside its {} bytes",
                owner.as_ref().as_ref().len()
            ))
        })?;
        let (status, ptr) = raw::wrap_host(&self.raw.lib, self.raw.ptr, bytes);
        let len = bytes.len();
        self.buffer("tk_buffer_wrap_host", status, ptr, len, Some(owner))
    }

    /// Allocates a buffer holding `data`.
    pub fn upload<T: bytemuck::Pod>(&self, data: &[T]) -> Result<Buffer> {
        let buf = self.alloc(std::mem::size_of_val(data))?;
        self.write(buf.view(), data)?;
        Ok(buf)
    }

    pub fn write<T: bytemuck::Pod>(&self, dst: View<'_>, data: &[T]) -> Result<()> {
        let _timed = crate::profile::timed("tk_copy_h2d");
        let status = raw::copy_h2d(&self.raw.lib, self.raw.ptr, self.arg(dst)?, bytemuck::cast_slice(data));
        self.check("tk_copy_h2d", status)
    }

    pub fn read<T: bytemuck::Pod>(&self, src: View<'_>, out: &mut [T]) -> Result<()> {
        let _timed = crate::profile::timed("tk_copy_d2h");
        let status = raw::copy_d2h(&self.raw.lib, self.raw.ptr, bytemuck::cast_slice_mut(out), self.arg(src)?);
        self.check("tk_copy_d2h", status)
    }

    pub fn read_vec<T: bytemuck::Pod + Default>(&self, src: View<'_>, len: usize) -> Result<Vec<T>> {
        let mut out = vec![T::default(); len];
        self.read(src, &mut out)?;
        Ok(out)
    }

    pub fn copy(&self, dst: View<'_>, src: View<'_>, bytes: usize) -> Result<()> {
        let _timed = crate::profile::timed("tk_copy_d2d");
        let status = raw::copy_d2d(&self.raw.lib, self.raw.ptr, self.arg(dst)?, self.arg(src)?, bytes as u64);
        self.check("tk_copy_d2d", status)
    }

    pub fn synchronize(&self) -> Result<()> {
        self.check("tk_synchronize", raw::synchronize(&self.raw.lib, self.raw.ptr))
    }

    #[allow(clippy::too_many_arguments)]
    pub fn embedding(
        &self,
        out: View<'_>,
        table: View<'_>,
        ty: impl WeightType,
        ids: View<'_>,
        n: u32,
        hidden: u32,
        vocab: u32,
    ) -> Result<()> {
        let _timed = crate::profile::timed("tk_embedding");
        let s = raw::embedding(
            &self.raw.lib,
            self.raw.ptr,
            self.arg(out)?,
            self.arg(table)?,
            ty.weight_type().to_abi(),
            self.arg(ids)?,
            n,
            hidden,
            vocab,
        );
        self.check("tk_embedding", s)
    }

    /// `out[m][n] = x[m][k] · w[n][k]ᵀ (+ bias)`; `w` of type `ty` (a block format needs
    /// kernel ABI 1.2, and its bias is f32).
    #[allow(clippy::too_many_arguments)]
    pub fn linear(
        &self,
        out: View<'_>,
        x: View<'_>,
        w: View<'_>,
        ty: impl WeightType,
        bias: Option<View<'_>>,
        m: u32,
        n: u32,
        k: u32,
    ) -> Result<()> {
        let _timed = crate::profile::timed("tk_linear");
        let s = raw::linear(
            &self.raw.lib,
            self.raw.ptr,
            self.arg(out)?,
            self.arg(x)?,
            self.arg(w)?,
            ty.weight_type().to_abi(),
            self.opt_arg(bias)?,
            m,
            n,
            k,
        );
        self.check("tk_linear", s)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        out: View<'_>,
        x: View<'_>,
        w: View<'_>,
        dtype: DType,
        n: u32,
        hidden: u32,
        eps: f32,
    ) -> Result<()> {
        let _timed = crate::profile::timed("tk_rms_norm");
        let s = raw::rms_norm(
            &self.raw.lib,
            self.raw.ptr,
            self.arg(out)?,
            self.arg(x)?,
            self.arg(w)?,
            dtype.to_abi(),
            n,
            hidden,
            eps,
        );
        self.check("tk_rms_norm", s)
    }

    /// `residual += x; out = rms_norm(residual) * w`.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm(
        &self,
        residual: View<'_>,
        x: View<'_>,
        w: View<'_>,
        dtype: DType,
        out: View<'_>,
        n: u32,
        hidden: u32,
        eps: f32,
    ) -> Result<()> {
        let _timed = crate::profile::timed("tk_add_rms_norm");
        let s = raw::add_rms_norm(
            &self.raw.lib,
            self.raw.ptr,
            self.arg(residual)?,
            self.arg(x)?,
            self.arg(w)?,
            dtype.to_abi(),
            self.arg(out)?,
            n,
            hidden,
            eps,
        );
        self.check("tk_add_rms_norm", s)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn apply_rotary_pos_emb(
        &self,
        q: View<'_>,
        k: View<'_>,
        positions: View<'_>,
        n: u32,
        num_heads: u32,
        num_kv_heads: u32,
        head_dim: u32,
        rope: &abi::TkRope,
    ) -> Result<()> {
        let _timed = crate::profile::timed("tk_apply_rotary_pos_emb");
        let s = raw::apply_rotary_pos_emb(
            &self.raw.lib,
            self.raw.ptr,
            self.arg(q)?,
            self.arg(k)?,
            self.arg(positions)?,
            n,
            num_heads,
            num_kv_heads,
            head_dim,
            rope,
        );
        self.check("tk_apply_rotary_pos_emb", s)
    }

    pub fn silu_and_mul(&self, out: View<'_>, gate: View<'_>, up: View<'_>, n: u32, inter: u32) -> Result<()> {
        let _timed = crate::profile::timed("tk_silu_and_mul");
        let s =
            raw::silu_and_mul(&self.raw.lib, self.raw.ptr, self.arg(out)?, self.arg(gate)?, self.arg(up)?, n, inter);
        self.check("tk_silu_and_mul", s)
    }

    pub fn fill_kv_cache(
        &self,
        cache: &KvCacheView<'_>,
        k: View<'_>,
        v: View<'_>,
        slots: View<'_>,
        n: u32,
    ) -> Result<()> {
        let _timed = crate::profile::timed("tk_fill_kv_cache");
        let s = raw::fill_kv_cache(
            &self.raw.lib,
            self.raw.ptr,
            &self.kv_arg(cache)?,
            self.arg(k)?,
            self.arg(v)?,
            self.arg(slots)?,
            n,
        );
        self.check("tk_fill_kv_cache", s)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn prefill_attention(
        &self,
        out: View<'_>,
        q: View<'_>,
        cache: &KvCacheView<'_>,
        batch: &AttnBatchView<'_>,
        total_q: u32,
        num_heads: u32,
        scale: f32,
    ) -> Result<()> {
        let _timed = crate::profile::timed("tk_prefill_attention");
        let b = abi::TkAttnBatch {
            num_seqs: batch.num_seqs,
            max_blocks_per_seq: batch.max_blocks_per_seq,
            query_start: self.arg(batch.query_start)?,
            context_lens: self.arg(batch.context_lens)?,
            block_tables: self.arg(batch.block_tables)?,
        };
        let s = raw::prefill_attention(
            &self.raw.lib,
            self.raw.ptr,
            self.arg(out)?,
            self.arg(q)?,
            &self.kv_arg(cache)?,
            &b,
            total_q,
            num_heads,
            scale,
        );
        self.check("tk_prefill_attention", s)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn paged_decode_attention(
        &self,
        out: View<'_>,
        q: View<'_>,
        cache: &KvCacheView<'_>,
        block_tables: View<'_>,
        context_lens: View<'_>,
        num_seqs: u32,
        max_blocks_per_seq: u32,
        num_heads: u32,
        scale: f32,
    ) -> Result<()> {
        let _timed = crate::profile::timed("tk_paged_decode_attention");
        let s = raw::paged_decode_attention(
            &self.raw.lib,
            self.raw.ptr,
            self.arg(out)?,
            self.arg(q)?,
            &self.kv_arg(cache)?,
            self.arg(block_tables)?,
            self.arg(context_lens)?,
            num_seqs,
            max_blocks_per_seq,
            num_heads,
            scale,
        );
        self.check("tk_paged_decode_attention", s)
    }

    pub fn argmax(&self, out: View<'_>, logits: View<'_>, n: u32, vocab: u32) -> Result<()> {
        let _timed = crate::profile::timed("tk_argmax");
        let s = raw::argmax(&self.raw.lib, self.raw.ptr, self.arg(out)?, self.arg(logits)?, n, vocab);
        self.check("tk_argmax", s)
    }

    pub fn log_softmax(&self, out: View<'_>, logits: View<'_>, n: u32, vocab: u32) -> Result<()> {
        let _timed = crate::profile::timed("tk_log_softmax");
        let s = raw::log_softmax(&self.raw.lib, self.raw.ptr, self.arg(out)?, self.arg(logits)?, n, vocab);
        self.check("tk_log_softmax", s)
    }
}
