//! The chip catalog: the kinds a topology may name in `hosts.chips.kind`, with public
//! figures for the planner and the sims. Every entry carries where its figures come from
//! and how sure they are; figures nobody could trace to a primary source stay flagged
//! `"unconfirmed"` so that nothing downstream mistakes them for measurements.

/// One kind of chip. Figures are per chip (per card for dual-chip cards), as published.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChipKind {
    /// The name topology files use, e.g. `"nvidia-h100"`.
    pub name: &'static str,
    pub vendor: &'static str,
    /// The product as the vendor names it, e.g. `"H100 SXM"`.
    pub product: &'static str,
    /// Dense FP16/BF16 peak, TFLOPS.
    pub fp16_tflops: f64,
    /// Device memory as the vendor quotes it ("80 GB" is recorded as 80.0).
    pub memory_gib: f64,
    /// Peak device-memory bandwidth, GB/s.
    pub memory_bw_gbs: f64,
    /// `"confirmed"` (primary source), `"unconfirmed"` (commonly quoted, no primary
    /// source found) or `"measured"` (no catalogued figures: measured at run time).
    pub confidence: &'static str,
    /// Where the figures come from.
    pub source: &'static str,
}

/// Source of the figures: /work/shared/reference/chips.md (public spec sheets and reports).
static KINDS: &[ChipKind] = &[
    ChipKind {
        name: "cpu",
        vendor: "host",
        product: "the host CPU",
        fp16_tflops: 0.0,
        memory_gib: 0.0,
        memory_bw_gbs: 0.0,
        confidence: "measured",
        source: "measured at run time on the host (`tessera bench engine`); no catalogued figures",
    },
    ChipKind {
        name: "nvidia-a100",
        vendor: "NVIDIA",
        product: "A100 80GB SXM",
        fp16_tflops: 312.0,
        memory_gib: 80.0,
        memory_bw_gbs: 2039.0,
        confidence: "confirmed",
        source: "NVIDIA A100 datasheet",
    },
    ChipKind {
        name: "nvidia-h100",
        vendor: "NVIDIA",
        product: "H100 SXM",
        fp16_tflops: 989.0,
        memory_gib: 80.0,
        memory_bw_gbs: 3350.0,
        confidence: "confirmed",
        source: "NVIDIA H100 datasheet",
    },
    ChipKind {
        name: "nvidia-h200",
        vendor: "NVIDIA",
        product: "H200 SXM",
        fp16_tflops: 989.0,
        memory_gib: 141.0,
        memory_bw_gbs: 4800.0,
        confidence: "confirmed",
        source: "MLCommons v4.1 system json (141 GB, 700 W); 4.8 TB/s bandwidth from secondary sources",
    },
    ChipKind {
        name: "ascend-910b",
        vendor: "Huawei",
        product: "Ascend 910B (910B2)",
        fp16_tflops: 354.0,
        memory_gib: 64.0,
        memory_bw_gbs: 1600.0,
        confidence: "confirmed",
        source: "CANN Ascend910B2C.ini: 24 cores x 16^3 MAC x 1.8 GHz",
    },
    ChipKind {
        name: "cambricon-mlu370",
        vendor: "Cambricon",
        product: "MLU370-X8 (dual-chip card)",
        fp16_tflops: 96.0,
        memory_gib: 48.0,
        memory_bw_gbs: 614.0,
        confidence: "confirmed",
        source: "Cambricon launch figures (2022-03), per card",
    },
    ChipKind {
        name: "metax-c500",
        vendor: "MetaX",
        product: "C500",
        fp16_tflops: 280.0,
        memory_gib: 64.0,
        memory_bw_gbs: 1800.0,
        confidence: "unconfirmed",
        source: "secondary sources only (~280 TFLOPS, ~1.8 TB/s)",
    },
    ChipKind {
        name: "biren-br100",
        vendor: "Biren",
        product: "BR100",
        fp16_tflops: 1024.0,
        memory_gib: 64.0,
        memory_bw_gbs: 1640.0,
        confidence: "unconfirmed",
        source: "Hot Chips 34 coverage; TFLOPS is the vendor figure (sparsity not stated); \
                 bandwidth sources conflict (1,640 or 2,300 GB/s), the lower is kept",
    },
];

/// The catalog entry named `name`, if any.
pub fn lookup(name: &str) -> Option<&'static ChipKind> {
    KINDS.iter().find(|kind| kind.name == name)
}

/// Every kind in the catalog, `cpu` first.
pub fn kinds() -> &'static [ChipKind] {
    KINDS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_every_entry_says_where_it_comes_from() {
        for (i, kind) in kinds().iter().enumerate() {
            assert!(kinds()[..i].iter().all(|other| other.name != kind.name), "duplicate {}", kind.name);
            assert!(!kind.source.is_empty(), "{} has no source", kind.name);
            assert!(["confirmed", "unconfirmed", "measured"].contains(&kind.confidence), "{}", kind.name);
        }
    }

    #[test]
    fn lookup_finds_the_reference_chips() {
        let h100 = lookup("nvidia-h100").map(|kind| (kind.fp16_tflops, kind.memory_bw_gbs));
        assert_eq!(h100, Some((989.0, 3350.0)));
        assert_eq!(lookup("metax-c500").map(|kind| kind.confidence), Some("unconfirmed"));
        assert_eq!(lookup("biren-br100").map(|kind| kind.confidence), Some("unconfirmed"));
        assert_eq!(lookup("cpu").map(|kind| kind.confidence), Some("measured"));
        assert!(lookup("nvidia-b200").is_none());
        for name in ["nvidia-a100", "nvidia-h200", "ascend-910b", "cambricon-mlu370"] {
            assert!(lookup(name).is_some_and(|kind| kind.memory_gib > 0.0), "{name}");
        }
    }
}
