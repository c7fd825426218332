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
/// Price, US dollars per chip-hour: a hundredth of a cent to $100,000.
pub const PRICE_USD_PER_HOUR_RANGE: RangeInclusive<f64> = 0.0001..=100_000.0;

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
    /// What an hour of the chip costs, if known: the simulator's cost and goodput per
    /// dollar, and the solver's equal-cost comparisons.
    pub price: Option<Price>,
}

/// What an hour of one chip costs, and how sure that figure is.
#[derive(Debug, Clone, PartialEq)]
pub struct Price {
    /// US dollars per chip-hour.
    pub usd_per_hour: f64,
    pub confidence: Confidence,
    /// Where the figure comes from, or how it was estimated.
    pub source: String,
}

impl ChipKind {
    /// Device memory in GiB.
    pub fn memory_gib(&self) -> f64 {
        self.memory_bytes as f64 / GIB as f64
    }

    /// The peaks a step's time is measured against.
    pub fn roof(&self) -> tessera_perf::Roof {
        tessera_perf::Roof { fp16_tflops: self.fp16_tflops, memory_bw_gbs: self.memory_bw_gbs }
    }

    /// The chip's link to its peers in one machine (tensor-parallel all-reduces,
    /// pipeline activations): half its quoted interconnect bandwidth (one way), 5 us a
    /// transfer.
    pub fn chip_link(&self) -> tessera_perf::Link {
        tessera_perf::Link { bandwidth_gbs: self.link_bw_gbs / 2.0, latency_s: 5e-6 }
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
    price: Price,
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
        price: Some(price),
    }
}

/// No public per-hour price was found for any built-in kind, so every price is an
/// estimate, anchored on one figure: an A100 80GB hour at $5.12, one eighth of the
/// on-demand list price of an 8 x A100 80GB cloud instance (p4de.24xlarge, $40.97/h)
/// as recalled, not verified here. The H100 is priced at 2.15 x the A100, Splitwise's
/// iso-cost ratio (86 DGX-A100 cost as much as 40 DGX-H100; chips.md); the other
/// accelerators at the A100's price scaled by their memory bandwidth (decode, the
/// phase most chip-hours go to, then costs the same per byte moved on each). Operators
/// with real prices set them per scenario (`[prices]`) or per `[[chip_kinds]]` entry.
const A100_USD_PER_HOUR: f64 = 5.12;

fn by_bandwidth(memory_bw_gbs: f64) -> Price {
    estimate(
        A100_USD_PER_HOUR * memory_bw_gbs / 2039.0,
        "estimate: no public price; the A100's $5.12/h scaled by memory bandwidth",
    )
}

fn estimate(usd_per_hour: f64, source: &str) -> Price {
    // Cents, as a price list shows it.
    Price {
        usd_per_hour: (usd_per_hour * 100.0).round() / 100.0,
        confidence: Confidence::Estimate,
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
            estimate(
                4.90,
                "estimate: half the on-demand list price of a 2-socket EPYC 9654 cloud instance (c7a.48xlarge, ~$9.85/h) as recalled, not verified",
            ),
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
            estimate(
                A100_USD_PER_HOUR,
                "estimate: 1/8 of an 8 x A100 80GB instance's on-demand list price (p4de.24xlarge, $40.97/h) as recalled, not verified",
            ),
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
            estimate(
                A100_USD_PER_HOUR * 2.15,
                "estimate: the A100's $5.12/h x 2.15, Splitwise's iso-cost ratio (86 DGX-A100 = 40 DGX-H100)",
            ),
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
            estimate(
                A100_USD_PER_HOUR * 2.15 * 4800.0 / 3350.0,
                "estimate: the H100's price scaled by memory bandwidth (4.8 vs 3.35 TB/s)",
            ),
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
            by_bandwidth(1600.0),
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
            by_bandwidth(614.0),
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
            by_bandwidth(1800.0),
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
            by_bandwidth(1640.0),
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

/// The built-in kinds' names and then `extra`'s (a file's `[[chip_kinds]]`), as an
/// error lists the kinds a name may take.
pub fn names_with(extra: &[ChipKind]) -> String {
    let names: Vec<&str> = kinds().iter().chain(extra).map(|kind| kind.name.as_str()).collect();
    names.join(", ")
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

    #[test]
    fn every_kind_has_a_marked_price_and_paces_the_reference_step_under_a_day() {
        // What validation relies on: at the default efficiencies no built-in kind can be
        // refused for its pace, whatever time_scale (at most 1e6) a file sets.
        let emu = crate::EmulationSpec { time_scale: 1e6, ..crate::EmulationSpec::default() };
        for kind in kinds() {
            let r = emu.reference_step(kind);
            assert!(r.unscaled_s * emu.time_scale < crate::perf::MAX_STEP_S, "{}: {r:?}", kind.name);
            let Some(price) = &kind.price else { panic!("{} has no price", kind.name) };
            assert!(PRICE_USD_PER_HOUR_RANGE.contains(&price.usd_per_hour), "{}", kind.name);
            // No built-in price is sourced: each says so.
            assert_eq!(price.confidence, Confidence::Estimate, "{}", kind.name);
            assert!(price.source.starts_with("estimate"), "{}", kind.name);
        }
        // Splitwise's iso-cost ratio holds between the H100 and the A100.
        let usd = |name| lookup(name).and_then(|k| k.price.as_ref()).map_or(0.0, |p| p.usd_per_hour);
        assert!((usd("nvidia-h100") / usd("nvidia-a100") - 2.15).abs() < 0.01);
    }
}
