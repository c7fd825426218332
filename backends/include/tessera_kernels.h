/*
 * tessera_kernels.h — the Tessera kernel ABI.
 *
 * A vendor ships a shared library exporting every function below; Tessera loads it at
 * run time (dlopen) and calls nothing else. The op set follows the fused LLM ops that
 * inference middlewares expose. The reference implementation is backends/cpu.
 *
 * Conventions
 *  - Every call returns tk_status; on failure tk_last_error() describes what was wrong
 *    (a thread-local string owned by the library, valid until the next call on the
 *    same thread).
 *  - Tensors are passed as tk_ptr {buffer, byte offset}; shapes are explicit
 *    arguments; all shapes are row-major and contiguous. A library must check that
 *    every tensor fits inside its buffer and refuse the call otherwise.
 *  - Activations are float32. Weights may be f32, f16 or bf16 (a tk_dtype argument).
 *    The KV cache may be f32, f16 or bf16. Index tensors are int32.
 *  - Ops, copies and tk_synchronize on a device are issued by one host thread at a
 *    time. The memory calls tk_alloc, tk_buffer_wrap_host and tk_free must be
 *    thread-safe: a buffer may be freed from any thread while ops run. Calls may be
 *    asynchronous with respect to the host; tk_synchronize() waits for all of them.
 *    Copies to the host (tk_copy_d2h) are synchronous.
 *  - Exported functions never unwind across the ABI.
 */
#ifndef TESSERA_KERNELS_H
#define TESSERA_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ABI version. tk_abi_version() returns (MAJOR << 16) | MINOR. A loader accepts a
 * library whose major equals its own and whose minor is at least the one it needs.
 *
 * History
 *  1.0  initial op set.
 *  1.1  tk_kv_cache.layout: token-major KV blocks beside head-major ones (so chips
 *       that disagree on layout can exchange KV, the receiver's kernels converting).
 *  1.2  quantized weight dtypes (ggml's block formats) for tk_embedding's table and
 *       tk_linear's w. A loader still accepts a 1.1 library for float weights and
 *       refuses to load quantized weights onto it.
 *  1.3  tk_device_set_matmul_precision (optional symbol): a device's linear layers may
 *       compute prompts in bfloat16. A loader still accepts a 1.1 or 1.2 library and
 *       refuses to ask one for anything but TK_MATMUL_F32.
 *  1.4  collectives (optional symbols, all four or none): tk_comm_create,
 *       tk_comm_destroy, tk_comm_abort, tk_all_reduce_sum_f32. A library whose chips
 *       can sum across each other natively (a collective library, a fabric) joins the
 *       tensor-parallel ranks of a stage itself; Tessera gives a library without them
 *       its own host all-reduce. A loader still accepts a 1.1 to 1.3 library.
 *  1.5  TK_DTYPE_Q5_K (ggml's Q5_K blocks) for tk_embedding and tk_linear. A loader
 *       refuses to load Q5_K weights onto an older library. */
#define TK_ABI_MAJOR 1
#define TK_ABI_MINOR 5

typedef int32_t tk_status;
#define TK_OK 0
#define TK_ERR_INVALID_ARGUMENT 1
#define TK_ERR_OUT_OF_MEMORY 2
#define TK_ERR_UNSUPPORTED 3
#define TK_ERR_INTERNAL 4

typedef int32_t tk_dtype;
#define TK_DTYPE_F32 0
#define TK_DTYPE_F16 1
#define TK_DTYPE_BF16 2
#define TK_DTYPE_I32 3
/* Quantized weights (since 1.2): rows of ggml blocks, byte for byte as ggml-common.h
 * defines them (block_q4_0, block_q4_1, block_q5_0, block_q5_1, block_q8_0: 32 values;
 * block_q4_K, block_q6_K: 256 values). A tensor of such a dtype is given by its byte
 * address; each row of k values is k / block_values blocks, so k must be a multiple
 * of the block's value count. No alignment beyond 1 byte is required. */
#define TK_DTYPE_Q4_0 16
#define TK_DTYPE_Q4_1 17
#define TK_DTYPE_Q5_0 18
#define TK_DTYPE_Q5_1 19
#define TK_DTYPE_Q8_0 20
#define TK_DTYPE_Q4_K 21
#define TK_DTYPE_Q6_K 22
#define TK_DTYPE_Q5_K 23 /* since 1.5 */

/* Rope scaling kinds (tk_rope.scaling). */
#define TK_ROPE_NONE 0
#define TK_ROPE_LLAMA3 1
#define TK_ROPE_LINEAR 2

typedef struct tk_device tk_device;
typedef struct tk_buffer tk_buffer;

typedef struct {
    uint32_t threads;            /* worker threads; 0 = all cores */
    uint32_t device_index;       /* which physical device, for multi-device libraries */
    uint64_t memory_limit_bytes; /* 0 = whatever the device has */
} tk_device_config;

typedef struct {
    char name[64];               /* NUL-terminated */
    uint64_t memory_bytes;       /* usable device memory (the limit if one was set) */
    uint32_t compute_units;      /* cores / SMs / AI cores */
    uint32_t host_memory_shared; /* 1: tk_buffer_wrap_host is zero-copy */
} tk_device_info;

/* A tensor argument: a buffer plus a byte offset into it. buf == NULL means "absent"
 * where an argument is documented as optional. */
typedef struct {
    tk_buffer *buf;
    uint64_t offset;
} tk_ptr;

/* HF rotary embedding, "rotate half" convention: for each head, dims [0, d/2) pair
 * with [d/2, d). inv_freq[i] = theta^(-2i/d), then scaled as `scaling` says:
 *  - TK_ROPE_LINEAR: inv_freq /= factor
 *  - TK_ROPE_LLAMA3: Llama-3.1 wavelength-dependent scaling with factor,
 *    low_freq_factor, high_freq_factor and original_max_position. */
typedef struct {
    float theta;
    uint32_t scaling;
    float factor;
    float low_freq_factor;
    float high_freq_factor;
    uint32_t original_max_position;
} tk_rope;

/* KV block layouts (tk_kv_cache.layout, since ABI 1.1). */
#define TK_KV_LAYOUT_HEAD_MAJOR 0  /* block = [num_kv_heads][block_size][head_dim] */
#define TK_KV_LAYOUT_TOKEN_MAJOR 1 /* block = [block_size][num_kv_heads][head_dim] */

/* One layer's paged KV cache. k and v are each num_blocks blocks of `dtype`, each block
 * holding block_size tokens in `layout`:
 *  - TK_KV_LAYOUT_HEAD_MAJOR: [num_blocks][num_kv_heads][block_size][head_dim]
 *  - TK_KV_LAYOUT_TOKEN_MAJOR: [num_blocks][block_size][num_kv_heads][head_dim]
 * Slot s is block s / block_size, offset s % block_size. A library refuses a layout
 * value it does not know (TK_ERR_INVALID_ARGUMENT) rather than guess.
 *
 * `layout` was added in 1.1 at the end of the struct; on LP64 it occupies what was
 * tail padding in 1.0, so the struct's size is unchanged. A 1.0 host never set it, so
 * hosts must be built against >= 1.1 to use a 1.1 library (the loader rule above). */
typedef struct {
    tk_ptr k;
    tk_ptr v;
    tk_dtype dtype;
    uint32_t num_blocks;
    uint32_t block_size;
    uint32_t num_kv_heads;
    uint32_t head_dim;
    uint32_t layout; /* TK_KV_LAYOUT_*; since 1.1 */
} tk_kv_cache;

/* A batch of sequences for attention over the paged cache. Sequence i owns queries
 * [query_start[i], query_start[i+1]) of the packed q tensor; those queries are the
 * LAST tokens of its context_lens[i] cached tokens (so a chunked prefill attends to
 * every earlier chunk), and query j of the sequence sits at position
 * context_lens[i] - q_len + j and attends causally to positions <= that.
 * block_tables is [num_seqs][max_blocks_per_seq]. */
typedef struct {
    uint32_t num_seqs;
    uint32_t max_blocks_per_seq;
    tk_ptr query_start;  /* i32 [num_seqs + 1] */
    tk_ptr context_lens; /* i32 [num_seqs] */
    tk_ptr block_tables; /* i32 [num_seqs][max_blocks_per_seq] */
} tk_attn_batch;

/* ---- library and device ------------------------------------------------------- */
uint32_t tk_abi_version(void);
const char *tk_last_error(void);
tk_status tk_device_create(const tk_device_config *config, tk_device **out);
void tk_device_destroy(tk_device *dev);
tk_status tk_device_info_get(tk_device *dev, tk_device_info *out);
tk_status tk_synchronize(tk_device *dev);

/* The arithmetic of tk_linear for prompts (since 1.3; optional: a library without the
 * symbol computes every product in f32). TK_MATMUL_F32: f32 products of the f32
 * activations and the weights as stored. TK_MATMUL_BF16: a library may round both
 * operands to bfloat16 (nearest even) and sum their products in f32 where that is
 * faster, for calls of more rows than a decode batch; decode-sized calls stay f32. A
 * library refuses a precision it does not offer (TK_ERR_UNSUPPORTED, e.g. a CPU
 * without bf16 dot products). Set it before the device's first op. */
#define TK_MATMUL_F32 0
#define TK_MATMUL_BF16 1
tk_status tk_device_set_matmul_precision(tk_device *dev, uint32_t precision);

/* ---- memory -------------------------------------------------------------------- */
tk_status tk_alloc(tk_device *dev, uint64_t bytes, tk_buffer **out);
/* Wrap caller-owned host memory as a READ-ONLY buffer (e.g. memory-mapped weights).
 * Zero-copy where host_memory_shared, else the library copies. The caller keeps the
 * memory alive until tk_free. Ops refuse a wrapped buffer as an output. */
tk_status tk_buffer_wrap_host(tk_device *dev, const void *host, uint64_t bytes,
                              tk_buffer **out);
tk_status tk_free(tk_device *dev, tk_buffer *buf);
tk_status tk_copy_h2d(tk_device *dev, tk_ptr dst, const void *src, uint64_t bytes);
tk_status tk_copy_d2h(tk_device *dev, void *dst, tk_ptr src, uint64_t bytes);
tk_status tk_copy_d2d(tk_device *dev, tk_ptr dst, tk_ptr src, uint64_t bytes);

/* ---- collectives (since 1.4; optional) ----------------------------------------- */
/* A communicator joins `ranks` devices of this library in this process, one per rank,
 * each driven by its own host thread: the tensor-parallel chips of one pipeline stage.
 * All four symbols or none. */
typedef struct tk_comm tk_comm;
tk_status tk_comm_create(uint32_t ranks, tk_comm **out);
/* After every rank's last call has returned. */
void tk_comm_destroy(tk_comm *comm);
/* Any thread, any time: every waiting and later tk_all_reduce_sum_f32 on comm fails
 * (TK_ERR_INTERNAL), so ranks whose peer died stop waiting. Idempotent. */
tk_status tk_comm_abort(tk_comm *comm);
/* Rank `rank`'s part, called on its own thread with its own device: replaces the
 * `count` float32 at buf with their sum over every rank's buf, added in rank order
 * (rank 0 + rank 1 + ...), so every rank ends with the same bits and the result equals
 * a host sum in that order. Returns once every rank's buf holds the sum. Every rank
 * passes the same count; a mismatch fails the call on every rank. A rank that waits
 * longer than timeout_ms for the others aborts the communicator. */
tk_status tk_all_reduce_sum_f32(tk_comm *comm, uint32_t rank, tk_device *dev, tk_ptr buf,
                                uint64_t count, uint32_t timeout_ms);

/* ---- ops ----------------------------------------------------------------------- */
/* out[i, :] = table[ids[i], :] as f32. table [vocab][hidden] of table_dtype (a float
 * dtype, or since 1.2 a quantized one). */
tk_status tk_embedding(tk_device *dev, tk_ptr out, tk_ptr table, tk_dtype table_dtype,
                       tk_ptr ids, uint32_t n, uint32_t hidden, uint32_t vocab);

/* out[m][n] = x[m][k] . w[n][k]^T (+ bias[n]); w and bias are of w_dtype; bias.buf may
 * be NULL. With a quantized w_dtype (since 1.2) the bias is f32, and a library may
 * quantize x per block of 32 (to 8 bits with an f32 scale, as llama.cpp does): the
 * result then differs from the dequantized weights' exact product by at most
 * sum over blocks of (max|x_block| / 254) * sum|w_block| (plus f32 rounding). */
tk_status tk_linear(tk_device *dev, tk_ptr out, tk_ptr x, tk_ptr w, tk_dtype w_dtype,
                    tk_ptr bias, uint32_t m, uint32_t n, uint32_t k);

/* out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * weight; weight [hidden] of w_dtype. */
tk_status tk_rms_norm(tk_device *dev, tk_ptr out, tk_ptr x, tk_ptr weight,
                      tk_dtype w_dtype, uint32_t n, uint32_t hidden, float eps);

/* residual += x; out = rms_norm(residual) * weight. out may not alias residual. */
tk_status tk_add_rms_norm(tk_device *dev, tk_ptr residual, tk_ptr x, tk_ptr weight,
                          tk_dtype w_dtype, tk_ptr out, uint32_t n, uint32_t hidden,
                          float eps);

/* In place: q [n][num_heads][head_dim], k [n][num_kv_heads][head_dim], positions i32 [n]. */
tk_status tk_apply_rotary_pos_emb(tk_device *dev, tk_ptr q, tk_ptr k, tk_ptr positions,
                                  uint32_t n, uint32_t num_heads, uint32_t num_kv_heads,
                                  uint32_t head_dim, const tk_rope *rope);

/* out[i][j] = silu(gate[i][j]) * up[i][j]; all [n][inter] f32. */
tk_status tk_silu_and_mul(tk_device *dev, tk_ptr out, tk_ptr gate, tk_ptr up, uint32_t n,
                          uint32_t inter);

/* Write k, v ([n][num_kv_heads][head_dim] f32) into the cache at slot_mapping (i32 [n]);
 * a negative slot skips that token. Values are rounded to the cache's dtype and placed
 * in its layout, which makes this op also the converter when KV arrives from a chip
 * with another block size, layout or dtype. */
tk_status tk_fill_kv_cache(tk_device *dev, const tk_kv_cache *cache, tk_ptr k, tk_ptr v,
                           tk_ptr slot_mapping, uint32_t n);

/* Causal GQA attention of packed queries over the paged cache (see tk_attn_batch).
 * q and out are [total_q][num_heads][head_dim] f32. */
tk_status tk_prefill_attention(tk_device *dev, tk_ptr out, tk_ptr q,
                               const tk_kv_cache *cache, const tk_attn_batch *batch,
                               uint32_t total_q, uint32_t num_heads, float scale);

/* One query per sequence: q and out [num_seqs][num_heads][head_dim] f32; each query
 * attends to all context_lens[i] cached tokens of its sequence. */
tk_status tk_paged_decode_attention(tk_device *dev, tk_ptr out, tk_ptr q,
                                    const tk_kv_cache *cache, tk_ptr block_tables,
                                    tk_ptr context_lens, uint32_t num_seqs,
                                    uint32_t max_blocks_per_seq, uint32_t num_heads,
                                    float scale);

/* out i32 [n] = argmax over each row of logits [n][vocab] (lowest index wins ties). */
tk_status tk_argmax(tk_device *dev, tk_ptr out, tk_ptr logits, uint32_t n, uint32_t vocab);

/* out [n][vocab] = log_softmax(logits) per row; out may equal logits. */
tk_status tk_log_softmax(tk_device *dev, tk_ptr out, tk_ptr logits, uint32_t n,
                         uint32_t vocab);

#ifdef __cplusplus
}
#endif
#endif /* TESSERA_KERNELS_H */
