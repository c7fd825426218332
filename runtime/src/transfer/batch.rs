//! Turning a batch of assignments into wire requests: validate, coalesce, split.
//!
//! Assignments are sorted by source offset and merged wherever the *source* is
//! contiguous, whatever the destinations: a request names source bytes only, and the
//! reader lays the response out over as many destination pieces as it covers. So KV
//! blocks that sit back to back on the writer travel as one request even when the
//! reader's free blocks are scattered. Requests are then cut at `chunk_bytes`.
#![forbid(unsafe_code)]

use std::ops::Range;

use super::{Assignment, TransferError};

/// `len` bytes to land at `dst_offset` of the local region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub dst_offset: u64,
    pub len: u64,
}

/// One request: `len` source bytes at `src_offset`, landing in `pieces` in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub src_offset: u64,
    pub len: u64,
    pub pieces: Range<usize>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    pub chunks: Vec<Chunk>,
    pub pieces: Vec<Piece>,
    pub bytes: u64,
}

fn out_of_bounds(side: &'static str, region: u64, offset: u64, len: u64, region_len: u64) -> TransferError {
    TransferError::OutOfBounds { side, region, offset, len, region_len }
}

/// Checks every assignment against both regions and that no two write the same local
/// bytes, then builds the requests. `(src_region, src_len)` and `(dst_region, dst_len)`
/// only name the regions in errors and bound the offsets.
pub(crate) fn plan(
    batch: &[Assignment],
    (src_region, src_len): (u64, u64),
    (dst_region, dst_len): (u64, u64),
    chunk_bytes: u64,
) -> Result<Plan, TransferError> {
    let chunk_bytes = chunk_bytes.max(1);
    let mut live: Vec<Assignment> = Vec::with_capacity(batch.len());
    for a in batch {
        if a.src_offset.checked_add(a.len).is_none_or(|end| end > src_len) {
            return Err(out_of_bounds("remote", src_region, a.src_offset, a.len, src_len));
        }
        if a.dst_offset.checked_add(a.len).is_none_or(|end| end > dst_len) {
            return Err(out_of_bounds("local", dst_region, a.dst_offset, a.len, dst_len));
        }
        if a.len > 0 {
            live.push(*a);
        }
    }

    live.sort_unstable_by_key(|a| a.dst_offset);
    for pair in live.windows(2) {
        if pair[0].dst_offset + pair[0].len > pair[1].dst_offset {
            return Err(TransferError::InvalidBatch(format!(
                "two assignments write local region {dst_region} at overlapping bytes: [{}, {}) and [{}, {})",
                pair[0].dst_offset,
                pair[0].dst_offset + pair[0].len,
                pair[1].dst_offset,
                pair[1].dst_offset + pair[1].len
            )));
        }
    }

    live.sort_by_key(|a| a.src_offset);
    let mut plan = Plan::default();
    for a in &live {
        plan.bytes += a.len;
        let (mut src, mut dst, mut left) = (a.src_offset, a.dst_offset, a.len);
        while left > 0 {
            let extend = plan.chunks.last().is_some_and(|c| c.src_offset + c.len == src && c.len < chunk_bytes);
            if !extend {
                let at = plan.pieces.len();
                plan.chunks.push(Chunk { src_offset: src, len: 0, pieces: at..at });
            }
            let Some(chunk) = plan.chunks.last_mut() else { unreachable!("a chunk was just pushed") };
            let take = left.min(chunk_bytes - chunk.len);
            match plan.pieces.last_mut() {
                // Contiguous on both sides within one chunk: one piece.
                Some(p) if chunk.pieces.end > chunk.pieces.start && p.dst_offset + p.len == dst => p.len += take,
                _ => {
                    plan.pieces.push(Piece { dst_offset: dst, len: take });
                    chunk.pieces.end += 1;
                }
            }
            chunk.len += take;
            src += take;
            dst += take;
            left -= take;
        }
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn a(src_offset: u64, dst_offset: u64, len: u64) -> Assignment {
        Assignment { src_offset, dst_offset, len }
    }

    #[test]
    fn contiguous_source_coalesces_across_scattered_destinations() {
        let batch = [a(0, 300, 100), a(100, 0, 100), a(200, 100, 100)];
        let p = plan(&batch, (1, 1000), (2, 1000), 1 << 20).unwrap();
        assert_eq!(p.chunks, vec![Chunk { src_offset: 0, len: 300, pieces: 0..2 }]);
        assert_eq!(p.pieces, vec![Piece { dst_offset: 300, len: 100 }, Piece { dst_offset: 0, len: 200 }]);
        assert_eq!(p.bytes, 300);
    }

    #[test]
    fn splits_at_chunk_bytes() {
        let p = plan(&[a(10, 0, 250)], (1, 1000), (2, 1000), 100).unwrap();
        let lens: Vec<_> = p.chunks.iter().map(|c| (c.src_offset, c.len)).collect();
        assert_eq!(lens, vec![(10, 100), (110, 100), (210, 50)]);
    }

    #[test]
    fn errors_name_side_region_and_offsets() {
        let e = plan(&[a(990, 0, 20)], (7, 1000), (8, 1000), 64).unwrap_err().to_string();
        assert!(e.contains("remote region 7") && e.contains("990") && e.contains("1000"), "{e}");
        let e = plan(&[a(0, u64::MAX, 2)], (7, 1000), (8, 1000), 64).unwrap_err().to_string();
        assert!(e.contains("local region 8"), "{e}");
        let e = plan(&[a(0, 0, 10), a(50, 5, 10)], (7, 1000), (8, 1000), 64).unwrap_err().to_string();
        assert!(e.contains("overlapping") && e.contains("[0, 10)") && e.contains("[5, 15)"), "{e}");
    }

    #[test]
    fn empty_and_zero_length_batches_plan_nothing() {
        assert_eq!(plan(&[], (1, 10), (2, 10), 4).unwrap(), Plan::default());
        assert_eq!(plan(&[a(3, 3, 0)], (1, 10), (2, 10), 4).unwrap(), Plan::default());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Replaying the plan on byte arrays gives what the assignments ask for.
        #[test]
        fn plan_moves_exactly_the_assigned_bytes(
            blocks in proptest::collection::vec((0u64..64, 1u64..9), 0..24),
            chunk in 1u64..40,
        ) {
            let src: Vec<u8> = (0..600u32).map(|i| (i * 7 + 3) as u8).collect();
            // Destinations: disjoint slots of 10 bytes, in order of appearance.
            let batch: Vec<Assignment> =
                blocks.iter().enumerate().map(|(i, &(s, len))| a(s * 8, i as u64 * 10, len)).collect();
            let p = plan(&batch, (1, src.len() as u64), (2, 300), chunk).unwrap();
            let mut got = vec![0u8; 300];
            for c in &p.chunks {
                prop_assert!(c.len <= chunk);
                let mut s = c.src_offset as usize;
                let covered: u64 = p.pieces[c.pieces.clone()].iter().map(|q| q.len).sum();
                prop_assert_eq!(covered, c.len);
                for q in &p.pieces[c.pieces.clone()] {
                    let (d, n) = (q.dst_offset as usize, q.len as usize);
                    got[d..d + n].copy_from_slice(&src[s..s + n]);
                    s += n;
                }
            }
            let mut want = vec![0u8; 300];
            for x in &batch {
                let (s, d, n) = (x.src_offset as usize, x.dst_offset as usize, x.len as usize);
                want[d..d + n].copy_from_slice(&src[s..s + n]);
            }
            prop_assert_eq!(got, want);
            prop_assert_eq!(p.bytes, batch.iter().map(|x| x.len).sum::<u64>());
        }
    }
}
