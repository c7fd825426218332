//! The byte format of KV blocks as they leave one chip and arrive at another: block
//! layout (head-major or token-major), dtype, block size and head shape.
//!
//! Prefill and decode chips may disagree on all of these (DESIGN.md §6). A sender ships
//! its blocks in its own native format, untouched; the receiver decodes the tokens it
//! needs to f32 rows here (pure host code, no device) and writes them with the
//! `fill_kv_cache` kernel, which rounds and places them in its own format. So exactly
//! one conversion happens, on receive, and the kernels own the destination layout.

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};
use tessera_kernel_abi as abi;

use crate::dtype::DType;
use crate::error::{BackendError, Result};

pub use tessera_vocab::KvLayout;

/// [`KvLayout`] as the kernels see it (`tk_kv_cache.layout`).
pub trait KvLayoutExt {
    fn to_abi(self) -> u32;

    /// Element offset inside one block of (kv head `head`, token `off`, element 0).
    fn offset_in_block(self, num_kv_heads: usize, block_size: usize, head_dim: usize, head: usize, off: usize)
    -> usize;
}

impl KvLayoutExt for KvLayout {
    fn to_abi(self) -> u32 {
        match self {
            KvLayout::HeadMajor => abi::TK_KV_LAYOUT_HEAD_MAJOR,
            KvLayout::TokenMajor => abi::TK_KV_LAYOUT_TOKEN_MAJOR,
        }
    }

    #[inline]
    fn offset_in_block(
        self,
        num_kv_heads: usize,
        block_size: usize,
        head_dim: usize,
        head: usize,
        off: usize,
    ) -> usize {
        match self {
            KvLayout::HeadMajor => (head * block_size + off) * head_dim,
            KvLayout::TokenMajor => (off * num_kv_heads + head) * head_dim,
        }
    }
}

/// Everything needed to interpret a chip's staged KV blocks: what one side announces
/// to the other before any bytes move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvFormat {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub layout: KvLayout,
    pub dtype: DType,
}

impl KvFormat {
    /// Elements in one block of K (or of V) of one layer.
    pub fn block_elems(&self) -> usize {
        self.block_size * self.num_kv_heads * self.head_dim
    }

    /// Bytes of one block of K (or of V) of one layer.
    pub fn block_bytes(&self) -> usize {
        self.block_elems() * self.dtype.size_bytes()
    }

    /// f32 elements of one token's K (or V) row, `[num_kv_heads][head_dim]`.
    pub fn row_elems(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

impl fmt::Display for KvFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} layers x {} kv heads x {} dims, blocks of {} tokens, {}, {}",
            self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.layout, self.dtype
        )
    }
}

/// Decodes tokens `positions` out of consecutive staged blocks and appends their rows to
/// `out` as f32 `[positions.len()][num_kv_heads][head_dim]`.
///
/// `blocks` holds whole blocks of one layer's K (or V), each `fmt.block_bytes()` long, in
/// `fmt`'s native layout and little-endian dtype; `first_pos` is the sequence position of
/// the first token of the first block. Positions outside the blocks, or a byte count that
/// is not a whole number of blocks, are an error and leave `out` unchanged.
pub fn decode_tokens(
    fmt: &KvFormat,
    blocks: &[u8],
    first_pos: usize,
    positions: Range<usize>,
    out: &mut Vec<f32>,
) -> Result<()> {
    let block_bytes = fmt.block_bytes();
    if block_bytes == 0 {
        return Err(BackendError::KvCache(format!("cannot decode blocks of an empty format ({fmt})")));
    }
    if !blocks.len().is_multiple_of(block_bytes) {
        return Err(BackendError::KvCache(format!(
            "{} staged bytes are not a whole number of {block_bytes}-byte blocks ({fmt})",
            blocks.len()
        )));
    }
    let covered = first_pos..first_pos + blocks.len() / block_bytes * fmt.block_size;
    if positions.start > positions.end || positions.start < covered.start || positions.end > covered.end {
        return Err(BackendError::KvCache(format!(
            "positions {positions:?} are outside the staged blocks, which hold positions {covered:?}"
        )));
    }
    let (hd, nkv, bs) = (fmt.head_dim, fmt.num_kv_heads, fmt.block_size);
    let es = fmt.dtype.size_bytes();
    out.reserve(positions.len() * fmt.row_elems());
    for pos in positions {
        let rel = pos - first_pos;
        let block = &blocks[rel / bs * block_bytes..][..block_bytes];
        for head in 0..nkv {
            let at = fmt.layout.offset_in_block(nkv, bs, hd, head, rel % bs) * es;
            let src = &block[at..at + hd * es];
            match fmt.dtype {
                DType::F32 => out.extend(src.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
                DType::F16 => out.extend(src.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())),
                DType::Bf16 => {
                    out.extend(src.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()))
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::f32_to_bytes;

    fn fmt(layout: KvLayout, dtype: DType, block_size: usize) -> KvFormat {
        KvFormat { num_layers: 1, num_kv_heads: 2, head_dim: 3, block_size, layout, dtype }
    }

    /// Value of (position, head, element): distinct and exact in every dtype.
    fn value(pos: usize, head: usize, e: usize) -> f32 {
        (pos * 8 + head * 4 + e) as f32
    }

    /// Staged blocks holding positions `first..first + n * bs`, laid out by hand.
    fn stage(f: &KvFormat, first: usize, nblocks: usize) -> Vec<u8> {
        let mut vals = vec![0f32; nblocks * f.block_elems()];
        for b in 0..nblocks {
            for off in 0..f.block_size {
                for h in 0..f.num_kv_heads {
                    for e in 0..f.head_dim {
                        let at = b * f.block_elems()
                            + match f.layout {
                                KvLayout::HeadMajor => (h * f.block_size + off) * f.head_dim + e,
                                KvLayout::TokenMajor => (off * f.num_kv_heads + h) * f.head_dim + e,
                            };
                        vals[at] = value(first + b * f.block_size + off, h, e);
                    }
                }
            }
        }
        f32_to_bytes(&vals, f.dtype)
    }

    #[test]
    fn decodes_every_layout_dtype_and_sub_range() {
        for layout in KvLayout::ALL {
            for dtype in [DType::F32, DType::F16, DType::Bf16] {
                for bs in [1, 3, 4] {
                    let f = fmt(layout, dtype, bs);
                    let first = 2 * bs;
                    let staged = stage(&f, first, 3);
                    assert_eq!(staged.len(), 3 * f.block_bytes());
                    // Every sub-range, including empty ones and ones crossing blocks.
                    for a in first..=first + 3 * bs {
                        for b in a..=first + 3 * bs {
                            let mut out = vec![-1.0];
                            decode_tokens(&f, &staged, first, a..b, &mut out).unwrap();
                            let want: Vec<f32> = std::iter::once(-1.0)
                                .chain(
                                    (a..b).flat_map(|p| (0..2).flat_map(move |h| (0..3).map(move |e| value(p, h, e)))),
                                )
                                .collect();
                            assert_eq!(out, want, "{f} positions {a}..{b}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn refuses_positions_outside_the_blocks_and_partial_blocks() {
        let f = fmt(KvLayout::TokenMajor, DType::F16, 4);
        let staged = stage(&f, 8, 2);
        let mut out = Vec::new();
        for bad in [7..9, 8..17, 16..17] {
            let err = decode_tokens(&f, &staged, 8, bad.clone(), &mut out).unwrap_err().to_string();
            assert!(err.contains("outside the staged blocks, which hold positions 8..16"), "{bad:?}: {err}");
        }
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = 10..9;
        assert!(decode_tokens(&f, &staged, 8, backwards, &mut out).is_err());
        let err = decode_tokens(&f, &staged[..staged.len() - 2], 8, 8..9, &mut out).unwrap_err().to_string();
        assert!(err.contains("not a whole number of 48-byte blocks"), "{err}");
        assert!(out.is_empty(), "a refused call appends nothing");
    }

    #[test]
    fn layout_names_round_trip() {
        for l in KvLayout::ALL {
            assert_eq!(l.to_string().parse::<KvLayout>().unwrap(), l);
            assert_eq!(serde_json::to_string(&l).unwrap(), format!("\"{l}\""));
        }
        assert_eq!(KvLayout::HeadMajor.to_abi(), abi::TK_KV_LAYOUT_HEAD_MAJOR);
        assert_eq!(KvLayout::TokenMajor.to_abi(), abi::TK_KV_LAYOUT_TOKEN_MAJOR);
        assert!("row-major".parse::<KvLayout>().unwrap_err().to_string().contains("head-major or token-major"));
        let f = fmt(KvLayout::TokenMajor, DType::Bf16, 16);
        assert_eq!(f.block_bytes(), 16 * 2 * 3 * 2);
        let json = serde_json::to_string(&f).unwrap();
        assert_eq!(serde_json::from_str::<KvFormat>(&json).unwrap(), f);
    }
}
