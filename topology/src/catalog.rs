//! The chip catalog: the built-in kinds a topology may name in `hosts.chips.kind` or in
//! an `emu:KIND` backend, with public figures for the planner, the emulator and the
//! sims. Every entry carries where its figures come from and how sure they are; figures
//! nobody could trace to a primary source stay flagged [`Confidence::Unconfirmed`] (or
//! [`Confidence::Estimate`]) so that nothing downstream mistakes them for measurements.
//! Operators add kinds of their own in a topology file (`[[chip_kinds]]`); those live
//! in [`crate::ClusterSpec::chip_kinds`], never here.

use std::ops::RangeInclusive;
use std::sync::LazyLock;

// The ranges every chip kind's figures fall in, built-in or `[[chip_kinds]]`: wide
// enough for any real chip (from a microcontroller to many times today's largest), and
// narrow enough that the roofline of every kind stays finite and that no product of a
// figure with another validated number overflows.

/// Dense FP16 peak, TFLOPS: 1 GFLOPS to 100 PFLOPS (today's largest chips: ~2.5 PFLOPS).
pub const FP16_TFLOPS_RANGE: RangeInclusive<f64> = 0.001..=100_000.0;
/// Device memory, bytes: 1 MiB to 1 PiB.
pub const MEMORY_BYTES_RANGE: RangeInclusive<u64> = (1 << 20)..=(1 << 50);
/// Memory bandwidth, GB/s: 100 MB/s to 100 TB/s (HBM3e: ~8 TB/s).
pub const MEMORY_BW_GBS_RANGE: RangeInclusive<f64> = 0.1..=100_000.0;
/// Chip-to-chip link bandwidth, GB/s: 10 MB/s (100 Mbit Ethernet) to 100 TB/s.
pub const LINK_BW_GBS_RANGE: RangeInclusive<f64> = 0.01..=100_000.0;
/// Board power, watts: 100 mW to 100 kW.
pub const TDP_W_RANGE: RangeInclusive<f64> = 0.1..=100_000.0;

/// One kind of chip. Figures are per chip (per card for dual-chip cards), as published.
#[derive(Debug, Clone, PartialEq)]
pub struct ChipKind {
    /// The name topology files use, e.g. `"nvidia-h100"`.
    pub name: String,
    pub vendor: String,
    /// The product as the vendor names it, e.g. `"H100 SXM"`.
    pub product: String,
    /// Dense (no sparsity) FP16/BF16 peak, TFLOPS.
    pub fp16_tflops: f64,
    /// Device memory. Vendors quote "80 GB"; HBM and LPDDR capacities are binary, so
    /// the catalog reads that as 80 GiB (usable memory is a little less).
    pub memory_bytes: u64,
    /// Peak device-memory bandwidth, GB/s (10^9 bytes per second).
    pub memory_bw_gbs: f64,
    /// Scale-up (chip-to-chip) link bandwidth, GB/s, both directions together as
    /// vendors quote NVLink.
    pub link_bw_gbs: f64,
    /// Board power, watts.
    pub tdp_w: f64,
    pub confidence: Confidence,
    /// Where the figures come from, and which value was picked where sources give a range.
    pub source: String,
}

impl ChipKind {
    /// Device memory in GiB.
    pub fn memory_gib(&self) -> f64 {
        self.memory_bytes as f64 / GIB as f64
    }

    /// Peak FLOP per byte of memory traffic: above it a step is compute bound.
    pub fn ridge_flop_per_byte(&self) -> f64 {
        self.fp16_tflops * 1e3 / self.memory_bw_gbs
    }
}

/// How far a catalog entry's figures can be trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Confidence {
    /// From a primary source (vendor datasheet, vendor software, MLCommons submission).
    Confirmed,
    /// Commonly quoted, but no primary source was found.
    Unconfirmed,
    /// Derived by us (e.g. from a generic part's public specs), not quoted by anyone.
    Estimate,
}

impl Confidence {
    pub const ALL: [Confidence; 3] = [Confidence::Confirmed, Confidence::Unconfirmed, Confidence::Estimate];

    pub fn as_str(self) -> &'static str {
        match self {
            Confidence::Confirmed => "confirmed",
            Confidence::Unconfirmed => "unconfirmed",
            Confidence::Estimate => "estimate",
        }
    }
}

impl std::fmt::Display for Confidence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Confidence {
    type Err = crate::UnknownName;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Confidence::ALL
            .into_iter()
            .find(|confidence| confidence.as_str() == text)
            .ok_or_else(|| crate::UnknownName::new("confidence", text, &["confirmed", "unconfirmed", "estimate"]))
    }
}

const GIB: u64 = 1 << 30;

/// A catalog row; the table below reads like chips.md.
#[allow(clippy::too_many_arguments)]
fn kind(
    name: &str,
    vendor: &str,
    product: &str,
    fp16_tflops: f64,
    memory_gib: u64,
    memory_bw_gbs: f64,
    link_bw_gbs: f64,
    tdp_w: f64,
    confidence: Confidence,
    source: &str,
) -> ChipKind {
    ChipKind {
        name: name.to_owned(),
        vendor: vendor.to_owned(),
        product: product.to_owned(),
        fp16_tflops,
        memory_bytes: memory_gib * GIB,
        memory_bw_gbs,
        link_bw_gbs,
        tdp_w,
        confidence,
        source: source.to_owned(),
    }
}

/// Source of the figures: /work/shared/reference/chips.md (public spec sheets and
/// reports), except `cpu`, which is our estimate.
static KINDS: LazyLock<Vec<ChipKind>> = LazyLock::new(|| {
    use Confidence::*;
    vec![
        kind(
            "cpu",
            "generic",
            "one socket of a current x86 server",
            14.7,
            768,
            460.8,
            512.0,
            360.0,
            Estimate,
            "estimate, not from chips.md: modelled on AMD EPYC 9654 public specs: 96 Zen 4 cores x 2.4 GHz x \
             64 BF16 FLOP/cycle (AVX-512 BF16) = 14.7 TFLOPS; 12 channels DDR5-4800 = 460.8 GB/s, 12 x 64 GB \
             DIMMs; socket link: 4 xGMI3 x16 links at 32 Gbps = 512 GB/s both directions; 360 W TDP",
        ),
        kind(
            "nvidia-a100",
            "NVIDIA",
            "A100 80GB SXM",
            312.0,
            80,
            2039.0,
            600.0,
            400.0,
            Confirmed,
            "NVIDIA A100 datasheet (NVLink3 600 GB/s)",
        ),
        kind(
            "nvidia-h100",
            "NVIDIA",
            "H100 SXM",
            989.0,
            80,
            3350.0,
            900.0,
            700.0,
            Confirmed,
            "NVIDIA H100 datasheet (NVLink4 900 GB/s)",
        ),
        kind(
            "nvidia-h200",
            "NVIDIA",
            "H200 SXM",
            989.0,
            141,
            4800.0,
            900.0,
            700.0,
            Confirmed,
            "MLCommons v4.1 system json (141 GB, NVLink 900 GB/s, 700 W); 4.8 TB/s bandwidth from secondary sources",
        ),
        kind(
            "ascend-910b",
            "Huawei",
            "Ascend 910B (910B2)",
            354.0,
            64,
            1600.0,
            392.0,
            400.0,
            Confirmed,
            "CANN Ascend910B2C.ini: 24 cores x 16^3 MAC x 1.8 GHz; 64 GB HBM2e at 1.6 TB/s. Unconfirmed: HCCS \
             ~392 GB/s, and TDP quoted as 310-400 W, the upper 400 W kept",
        ),
        kind(
            "cambricon-mlu370",
            "Cambricon",
            "MLU370-X8 (dual-chip card)",
            96.0,
            48,
            614.0,
            200.0,
            250.0,
            Confirmed,
            "Cambricon launch figures (2022-03), per card; MLU-Link 200 GB/s",
        ),
        kind(
            "metax-c500",
            "MetaX",
            "C500",
            280.0,
            64,
            1800.0,
            64.0,
            350.0,
            Unconfirmed,
            "secondary sources only (~280 TFLOPS, 64 GB HBM2e, ~1.8 TB/s, ~350 W); no public MetaXLink figure, \
             so the link is a PCIe 4.0 x16 floor (64 GB/s both directions)",
        ),
        kind(
            "biren-br100",
            "Biren",
            "BR100",
            1024.0,
            64,
            1640.0,
            2300.0,
            550.0,
            Unconfirmed,
            "Hot Chips 34 coverage; TFLOPS is the vendor figure (sparsity not stated); bandwidth sources \
             conflict (1,640 or 2,300 GB/s), the lower is kept; BLink 2.3 TB/s",
        ),
    ]
});

/// The built-in kind named `name`, if any.
pub fn lookup(name: &str) -> Option<&'static ChipKind> {
    KINDS.iter().find(|kind| kind.name == name)
}

/// Every built-in kind, `cpu` first.
pub fn kinds() -> &'static [ChipKind] {
    &KINDS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_every_entry_has_figures_and_a_source() {
        for (i, kind) in kinds().iter().enumerate() {
            assert!(kinds()[..i].iter().all(|other| other.name != kind.name), "duplicate {}", kind.name);
            assert!(!kind.source.is_empty(), "{} has no source", kind.name);
            let figures = [
                (kind.fp16_tflops, FP16_TFLOPS_RANGE),
                (kind.memory_bw_gbs, MEMORY_BW_GBS_RANGE),
                (kind.link_bw_gbs, LINK_BW_GBS_RANGE),
                (kind.tdp_w, TDP_W_RANGE),
            ];
            assert!(figures.iter().all(|(x, range)| range.contains(x)), "{}", kind.name);
            assert!(MEMORY_BYTES_RANGE.contains(&kind.memory_bytes), "{}", kind.name);
        }
    }

    #[test]
    fn lookup_finds_every_chip_of_chips_md() {
        let table: &[(&str, f64, f64, f64, f64, f64, Confidence)] = &[
            // name, TFLOPS, GiB, GB/s, link GB/s, W, confidence
            ("nvidia-a100", 312.0, 80.0, 2039.0, 600.0, 400.0, Confidence::Confirmed),
            ("nvidia-h100", 989.0, 80.0, 3350.0, 900.0, 700.0, Confidence::Confirmed),
            ("nvidia-h200", 989.0, 141.0, 4800.0, 900.0, 700.0, Confidence::Confirmed),
            ("ascend-910b", 354.0, 64.0, 1600.0, 392.0, 400.0, Confidence::Confirmed),
            ("cambricon-mlu370", 96.0, 48.0, 614.0, 200.0, 250.0, Confidence::Confirmed),
            ("metax-c500", 280.0, 64.0, 1800.0, 64.0, 350.0, Confidence::Unconfirmed),
            ("biren-br100", 1024.0, 64.0, 1640.0, 2300.0, 550.0, Confidence::Unconfirmed),
            ("cpu", 14.7, 768.0, 460.8, 512.0, 360.0, Confidence::Estimate),
        ];
        for &(name, tflops, gib, bw, link, tdp, confidence) in table {
            let kind = lookup(name).map(|k| (k.fp16_tflops, k.memory_gib(), k.memory_bw_gbs, k.link_bw_gbs, k.tdp_w));
            assert_eq!(kind, Some((tflops, gib, bw, link, tdp)), "{name}");
            assert_eq!(lookup(name).map(|k| k.confidence), Some(confidence), "{name}");
        }
        assert_eq!(kinds().len(), table.len());
        assert_eq!(kinds()[0].name, "cpu");
        assert!(lookup("nvidia-b200").is_none());
    }

    #[test]
    fn ridge_points_match_chips_md() {
        // chips.md: A100 153, H100 295, H200 206, 910B2 221, MLU370-X8 156 FLOP/byte.
        for (name, ridge) in [
            ("nvidia-a100", 153.0),
            ("nvidia-h100", 295.0),
            ("nvidia-h200", 206.0),
            ("ascend-910b", 221.0),
            ("cambricon-mlu370", 156.0),
        ] {
            let got = lookup(name).map_or(0.0, ChipKind::ridge_flop_per_byte);
            assert!((got - ridge).abs() < 1.0, "{name}: {got}");
        }
    }

    #[test]
    fn confidence_round_trips() {
        for confidence in Confidence::ALL {
            assert_eq!(confidence.as_str().parse::<Confidence>().ok(), Some(confidence));
        }
        assert!("measured".parse::<Confidence>().is_err());
    }
}
