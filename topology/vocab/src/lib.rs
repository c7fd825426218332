//! The words every Tessera crate shares — a chip's [`Role`], a KV block's [`KvLayout`],
//! an element [`DType`], and how KV blocks travel ([`TransportChoice`], [`Transport`]) —
//! defined once, so that the topology, the backends, the bus messages and the behaviors
//! compare enums, never strings. Each is written as the same lowercase name everywhere
//! (topology TOML, bus payloads, HTTP and `--json` outputs): `as_str`, `Display`, serde
//! and `FromStr` all use it, and `FromStr` refuses anything else with an [`UnknownName`]
//! that lists the accepted names. A host's socket address, an IP address or a DNS name
//! ([`Endpoint`]), is shared the same way. This crate depends on no other tessera crate.
#![forbid(unsafe_code)]

pub mod endpoint;
pub use endpoint::{Endpoint, HostAddr, ResolveError};

use serde::{Deserialize, Serialize};

/// A string that names none of a vocabulary enum's values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} `{name}`; expected {}", one_of(self.expected))]
pub struct UnknownName {
    /// What was being named, e.g. `"kv layout"`.
    pub what: &'static str,
    pub name: String,
    /// The names accepted.
    pub expected: &'static [&'static str],
}

impl UnknownName {
    pub fn new(what: &'static str, name: &str, expected: &'static [&'static str]) -> Self {
        UnknownName { what, name: name.to_owned(), expected }
    }
}

/// `a`, `a or b`, `a, b or c`.
fn one_of(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [only] => (*only).to_owned(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

/// An enum named by fixed lowercase strings: the enum itself (serde renamed to the
/// names), `ALL`, `NAMES`, `as_str`, `Display` and `FromStr`.
macro_rules! vocabulary {
    (
        $(#[$meta:meta])*
        pub enum $ty:ident ($what:literal) {
            $( $(#[$vmeta:meta])* $variant:ident = $name:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        pub enum $ty {
            $( $(#[$vmeta])* #[serde(rename = $name)] $variant ),+
        }

        impl $ty {
            pub const ALL: [$ty; [$($name),+].len()] = [$($ty::$variant),+];
            /// The names, in the order of [`Self::ALL`].
            pub const NAMES: &'static [&'static str] = &[$($name),+];

            pub const fn as_str(self) -> &'static str {
                match self {
                    $($ty::$variant => $name),+
                }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $ty {
            type Err = UnknownName;

            fn from_str(text: &str) -> Result<Self, Self::Err> {
                match text {
                    $($name => Ok($ty::$variant),)+
                    _ => Err(UnknownName::new($what, text, Self::NAMES)),
                }
            }
        }
    };
}

vocabulary! {
    /// The language of a structured output's grammar.
    pub enum GrammarKind ("grammar kind") {
        /// A JSON schema, as JSON text.
        JsonSchema = "json_schema",
        /// A regular expression the whole output matches (Rust `regex` syntax).
        Regex = "regex",
        /// A grammar in llguidance's Lark dialect (`start: ...`), which may embed JSON
        /// schemas (`%json { ... }`).
        Lark = "lark",
    }
}

vocabulary! {
    /// Which phases of a request a chip runs. A live role change (`SetRole`) moves a
    /// chip between them once it has drained.
    pub enum Role ("role") {
        Prefill = "prefill",
        Decode = "decode",
        Both = "both",
    }
}

impl Role {
    /// Runs prefills: `prefill` or `both`.
    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    /// Runs decodes: `decode` or `both`.
    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }
}

vocabulary! {
    /// How a chip orders the K and V entries inside one KV block. Chips that disagree
    /// convert on receive (DESIGN.md §6).
    #[derive(Default)]
    pub enum KvLayout ("kv layout") {
        /// `[kv_head][token][head_dim]`: each head's tokens contiguous, which attention
        /// kernels that stream a head at a time prefer.
        #[default]
        HeadMajor = "head-major",
        /// `[token][kv_head][head_dim]`: each token's heads contiguous, which is what a
        /// projection writes and what token-granular transfers prefer.
        TokenMajor = "token-major",
    }
}

vocabulary! {
    /// A floating-point element type of weights or of a KV cache (activations are f32).
    pub enum DType ("dtype") {
        F32 = "f32",
        F16 = "f16",
        Bf16 = "bf16",
    }
}

vocabulary! {
    /// How the router picks the chips of a request (`[router] policy` in a topology).
    #[derive(Default)]
    pub enum RouterPolicy ("router policy") {
        /// Least work ahead: placed tokens plus the prompt tokens the chip would
        /// compute, which its cached prefix reduces (a hot spot's cache aside).
        #[default]
        KvAware = "kv-aware",
        /// Least placed tokens, caches ignored.
        LeastLoaded = "least-loaded",
        /// In turn, by chip address.
        RoundRobin = "round-robin",
        /// Uniformly, seeded by the request id (reproducible).
        Random = "random",
        /// Dynamo's KV router cost, as published: blocks to prefill (the prompt's less
        /// those cached there) plus blocks in use, lowest wins.
        Dynamo = "dynamo",
    }
}

vocabulary! {
    /// Where the router places a request that finds every decoding chip (`decode` or
    /// `both`) full (`[router] decode_overflow`). Either way a prefill chip runs requests
    /// whole while no decoding chip is up, so a cluster keeps serving through a failure.
    #[derive(Default)]
    pub enum DecodeOverflow ("decode overflow") {
        /// Runs it whole on a prefill chip: more throughput, but the prefill chip's steps
        /// then carry decodes, and every prompt there waits for them.
        #[default]
        PrefillChips = "prefill-chips",
        /// Holds it in the router's queue until a decoding chip has room: prefill chips
        /// only prefill, so time to first token stays apart from the decode load (a
        /// light tenant beside a flood, say), at the cost of the prefill chips' spare
        /// decode capacity.
        Wait = "wait",
    }
}

vocabulary! {
    /// A tenant's priority class (`[[tenants]] priority`): admission, the router and the
    /// batchers serve higher classes first, and under KV pressure preempt lower ones
    /// first. Ordered from the highest.
    #[derive(Default)]
    pub enum PriorityClass ("priority class") {
        /// Chat and agents: a person is waiting.
        Interactive = "interactive",
        #[default]
        Standard = "standard",
        /// Offline work: served when nothing above it waits.
        Batch = "batch",
    }
}

vocabulary! {
    /// What the planes between hosts (bus, KV transfer) guarantee: `[security] mode`.
    pub enum SecurityMode ("security mode") {
        /// Plain frames: for a cluster whose every address is loopback.
        Off = "off",
        /// Hosts prove their listed keys; every frame carries a tag; bodies in clear.
        Authenticate = "authenticate",
        /// As `authenticate`, and every body encrypted.
        Encrypt = "encrypt",
    }
}

vocabulary! {
    /// The AEAD that seals frames between hosts: `[security] cipher`.
    #[derive(Default)]
    pub enum Cipher ("cipher") {
        /// ChaCha20-Poly1305 (RFC 8439): fast in software on any CPU.
        #[default]
        ChaCha20Poly1305 = "chacha20-poly1305",
        /// SM4-GCM (RFC 8998): China's national block cipher in GCM mode.
        Sm4Gcm = "sm4-gcm",
    }
}

vocabulary! {
    /// A block format a chip quantizes float weights to when it loads them (ggml's
    /// Q8_0: 8.5 bits per weight; Q4_0: 4.5). Weights already quantized in a GGUF file
    /// keep their own formats.
    pub enum Quantize ("quantization") {
        Q8_0 = "q8_0",
        Q4_0 = "q4_0",
    }
}

vocabulary! {
    /// The arithmetic of a chip's linear layers on prompts (chunks of more rows than a
    /// decode batch). Decode steps, bound by memory rather than arithmetic, always
    /// compute in f32.
    #[derive(Default)]
    pub enum MatmulPrecision ("matmul precision") {
        /// f32 products of the f32 activations and the weights as stored.
        #[default]
        F32 = "f32",
        /// Both operands rounded to bfloat16 (8 significant bits), their products
        /// summed in f32: about twice the prompt rate where the chip has bf16 dot
        /// products (a CPU with AVX512-BF16), at a precision cost (PyTorch's "medium"
        /// float32 matmul precision). A chip without them refuses it.
        Bf16 = "bf16",
    }
}

impl DType {
    /// Bytes of one element.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }
}

vocabulary! {
    /// How a cluster wants KV blocks to travel between chips (topology `disagg.transport`).
    #[derive(Default)]
    pub enum TransportChoice ("transport") {
        /// Shared memory between chips of one machine, TCP otherwise (and TCP when a
        /// same-machine peer's memory cannot be mapped, e.g. another pid namespace).
        #[default]
        Auto = "auto",
        /// Shared memory only: the transfer engine refuses a pair it cannot reach so.
        Shm = "shm",
        /// TCP always, even on one machine.
        Tcp = "tcp",
    }
}

vocabulary! {
    /// How one transfer actually moved: what [`TransportChoice::Auto`] resolves to for a
    /// pair of chips. Also the `transport` label of the transfer metrics.
    pub enum Transport ("transport") {
        Shm = "shm",
        Tcp = "tcp",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every value's name: `as_str`, `Display`, serde and `FromStr` agree, in both directions.
    fn round_trips<T, const N: usize>(all: [T; N], names: &[&str])
    where
        T: Copy + std::fmt::Debug + std::fmt::Display + PartialEq + Serialize + serde::de::DeserializeOwned,
        T: std::str::FromStr<Err = UnknownName>,
    {
        assert_eq!(all.len(), names.len());
        for (value, &name) in all.into_iter().zip(names) {
            assert_eq!(value.to_string(), name);
            assert_eq!(name.parse::<T>(), Ok(value));
            assert_eq!(serde_json::to_string(&value).unwrap(), format!("\"{name}\""));
            assert_eq!(serde_json::from_str::<T>(&format!("\"{name}\"")).unwrap(), value);
        }
    }

    #[test]
    fn names_are_the_strings_of_topology_files_and_the_wire() {
        round_trips(Role::ALL, &["prefill", "decode", "both"]);
        round_trips(KvLayout::ALL, &["head-major", "token-major"]);
        round_trips(DType::ALL, &["f32", "f16", "bf16"]);
        round_trips(TransportChoice::ALL, &["auto", "shm", "tcp"]);
        round_trips(Transport::ALL, &["shm", "tcp"]);
    }

    #[test]
    fn unknown_names_are_refused_listing_the_accepted_ones() {
        let cases: [(Result<(), UnknownName>, &str); 6] = [
            ("decoder".parse::<Role>().map(drop), "unknown role `decoder`; expected prefill, decode or both"),
            (
                "row-major".parse::<KvLayout>().map(drop),
                "unknown kv layout `row-major`; expected head-major or token-major",
            ),
            ("fp8".parse::<DType>().map(drop), "unknown dtype `fp8`; expected f32, f16 or bf16"),
            // Names are exact: no case folding, no aliases.
            ("F16".parse::<DType>().map(drop), "unknown dtype `F16`; expected f32, f16 or bf16"),
            ("rdma".parse::<TransportChoice>().map(drop), "unknown transport `rdma`; expected auto, shm or tcp"),
            ("auto".parse::<Transport>().map(drop), "unknown transport `auto`; expected shm or tcp"),
        ];
        for (result, message) in cases {
            assert_eq!(result.map_err(|e| e.to_string()), Err(message.to_owned()));
        }
    }

    #[test]
    fn serde_refuses_unknown_names() {
        let e = serde_json::from_str::<Role>("\"sideways\"").unwrap_err().to_string();
        assert!(e.contains("sideways") && e.contains("prefill"), "{e}");
    }

    #[test]
    fn role_helpers() {
        let table = [(Role::Prefill, true, false), (Role::Decode, false, true), (Role::Both, true, true)];
        for (role, prefills, decodes) in table {
            assert_eq!((role.prefills(), role.decodes()), (prefills, decodes), "{role}");
        }
    }

    #[test]
    fn dtype_sizes() {
        let sizes = DType::ALL.map(DType::size_bytes);
        assert_eq!(sizes, [4, 2, 2]);
    }

    #[test]
    fn lists_read_as_prose() {
        assert_eq!(one_of(&[]), "");
        assert_eq!(one_of(&["a"]), "a");
        assert_eq!(one_of(&["a", "b"]), "a or b");
        assert_eq!(one_of(&["a", "b", "c"]), "a, b or c");
    }
}
