//! The bounded fuzz layer of the GGUF reader (CI runs it; `tests/fuzz`'s `gguf_file`
//! target is the coverage-guided one): valid files of random metadata and tensors parse
//! back to what was written, and the same files with random byte edits, truncations and
//! huge counts, lengths, dimensions or offsets written over their u64 fields are refused
//! with an error or accepted soundly (every tensor inside the file, the loaders' readers
//! run), never a panic. `PROPTEST_CASES=100000 cargo test -p tessera-backends --lib
//! gguf::fuzz` runs it longer.

use std::path::Path;

use proptest::prelude::*;

use super::{GgmlType, Gguf, Value, hf, info};
use crate::config::ModelConfig;

/// Cases per property: `PROPTEST_CASES` when set (a longer local run), else what CI runs.
fn cases(ci: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(ci)
}

/// A metadata value as written: its type id and contents.
#[derive(Debug, Clone)]
enum Meta {
    /// A scalar of type 0..=7 or 10..=12; the low bytes of `raw` (bool: its low bit).
    Scalar(u32, u64),
    Str(String),
    /// Item type and items (all of that type).
    Array(u32, Vec<Meta>),
}

const SCALAR_TYPES: [u32; 11] = [0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12];

fn scalar_width(ty: u32) -> usize {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        _ => 8,
    }
}

/// A GGUF file being written, with where each of its u64 fields (counts, lengths,
/// dimensions, offsets) sits.
#[derive(Default)]
struct Out {
    bytes: Vec<u8>,
    u64_fields: Vec<usize>,
}

impl Out {
    fn u32(&mut self, v: u32) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }

    fn u64(&mut self, v: u64) {
        self.u64_fields.push(self.bytes.len());
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }

    fn string(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.bytes.extend_from_slice(s.as_bytes());
    }

    fn value(&mut self, m: &Meta) {
        match m {
            Meta::Scalar(7, raw) => self.bytes.push((raw & 1) as u8),
            Meta::Scalar(ty, raw) => self.bytes.extend_from_slice(&raw.to_le_bytes()[..scalar_width(*ty)]),
            Meta::Str(s) => self.string(s),
            Meta::Array(item, items) => {
                self.u32(*item);
                self.u64(items.len() as u64);
                for i in items {
                    self.value(i);
                }
            }
        }
    }
}

fn type_of(m: &Meta) -> u32 {
    match m {
        Meta::Scalar(ty, _) => *ty,
        Meta::Str(_) => 8,
        Meta::Array(..) => 9,
    }
}

/// A leaf of type `ty` (a scalar type or 8).
fn arb_leaf(ty: u32) -> BoxedStrategy<Meta> {
    if ty == 8 {
        "[a-zé<|> ]{0,6}".prop_map(Meta::Str).boxed()
    } else {
        any::<u64>().prop_map(move |raw| Meta::Scalar(ty, raw)).boxed()
    }
}

fn arb_leaf_type() -> impl Strategy<Value = u32> {
    prop_oneof![proptest::sample::select(SCALAR_TYPES.to_vec()), Just(8)]
}

fn arb_array() -> impl Strategy<Value = Meta> {
    arb_leaf_type()
        .prop_flat_map(|ty| proptest::collection::vec(arb_leaf(ty), 0..5).prop_map(move |items| Meta::Array(ty, items)))
}

fn arb_meta() -> impl Strategy<Value = Meta> {
    prop_oneof![
        4 => arb_leaf_type().prop_flat_map(arb_leaf),
        2 => arb_array(),
        1 => proptest::collection::vec(arb_array(), 0..3).prop_map(|a| Meta::Array(9, a)),
    ]
}

/// A tensor: its type, blocks per row and rows (1 row: a vector).
#[derive(Debug, Clone)]
struct Tensor {
    ty: GgmlType,
    blocks: u64,
    rows: u64,
    fill: u8,
}

impl Tensor {
    fn dims(&self) -> Vec<u64> {
        let cols = self.blocks * self.ty.block_elements();
        if self.rows == 1 { vec![cols] } else { vec![cols, self.rows] }
    }

    fn data(&self) -> Vec<u8> {
        let n = (self.blocks * self.rows * self.ty.block_bytes()) as usize;
        (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(self.fill)).collect()
    }
}

fn arb_tensor() -> impl Strategy<Value = Tensor> {
    (proptest::sample::select(GgmlType::ALL.to_vec()), 1..3u64, 1..4u64, any::<u8>())
        .prop_map(|(ty, blocks, rows, fill)| Tensor { ty, blocks, rows, fill })
}

/// A file's contents: a llama config and vocabulary (so the loaders' readers get past
/// their first checks), random extra metadata, tensors under names the loaders use.
#[derive(Debug, Clone)]
struct Spec {
    version: u32,
    alignment: u64,
    extra: Vec<Meta>,
    tensors: Vec<Tensor>,
}

const TENSOR_NAMES: [&str; 6] = [
    "token_embd.weight",
    "blk.0.attn_q.weight",
    "blk.0.attn_k.weight",
    "blk.0.attn_norm.weight",
    "output.weight",
    "blk.0.ffn_down.weight",
];

fn arb_spec() -> impl Strategy<Value = Spec> {
    (
        2..4u32,
        prop_oneof![Just(32u64), Just(1), Just(8), Just(256)],
        proptest::collection::vec(arb_meta(), 0..6),
        proptest::collection::vec(arb_tensor(), 0..TENSOR_NAMES.len()),
    )
        .prop_map(|(version, alignment, extra, tensors)| Spec { version, alignment, extra, tensors })
}

impl Spec {
    fn metadata(&self) -> Vec<(String, Meta)> {
        let s = |v: &str| Meta::Str(v.into());
        let u32 = |v: u64| Meta::Scalar(4, v);
        let mut m = vec![
            ("general.architecture".into(), s("llama")),
            ("general.alignment".into(), u32(self.alignment)),
            ("llama.block_count".into(), u32(1)),
            ("llama.embedding_length".into(), u32(64)),
            ("llama.feed_forward_length".into(), u32(128)),
            ("llama.attention.head_count".into(), u32(2)),
            ("tokenizer.ggml.model".into(), s("gpt2")),
            ("tokenizer.ggml.tokens".into(), Meta::Array(8, ["a", "b", "ab", "<s>"].map(s).to_vec())),
            ("tokenizer.ggml.merges".into(), Meta::Array(8, vec![s("a b")])),
            ("tokenizer.ggml.token_type".into(), Meta::Array(5, [1, 1, 1, 3].map(|t| Meta::Scalar(5, t)).to_vec())),
        ];
        m.extend(self.extra.iter().enumerate().map(|(i, v)| (format!("extra.{i}"), v.clone())));
        m
    }

    /// The file, laid out as llama.cpp writes one.
    fn write(&self) -> Out {
        let metadata = self.metadata();
        let mut out = Out::default();
        out.bytes.extend_from_slice(b"GGUF");
        out.u32(self.version);
        out.u64(self.tensors.len() as u64);
        out.u64(metadata.len() as u64);
        for (key, value) in &metadata {
            out.string(key);
            out.u32(type_of(value));
            out.value(value);
        }
        let mut offset = 0u64;
        let mut blobs = Vec::new();
        for (t, name) in self.tensors.iter().zip(TENSOR_NAMES) {
            out.string(name);
            let dims = t.dims();
            out.u32(dims.len() as u32);
            for d in dims {
                out.u64(d);
            }
            out.u32(t.ty.id());
            out.u64(offset);
            let data = t.data();
            blobs.push((offset, data.len()));
            offset = (offset + data.len() as u64).next_multiple_of(self.alignment);
        }
        let start = (out.bytes.len() as u64).next_multiple_of(self.alignment) as usize;
        for ((at, _), t) in blobs.iter().zip(&self.tensors) {
            out.bytes.resize(start + *at as usize, 0);
            out.bytes.extend_from_slice(&t.data());
        }
        out.bytes.resize(out.bytes.len().max(start), 0);
        out
    }
}

/// One damage to a file.
#[derive(Debug, Clone)]
enum Edit {
    Byte(prop::sample::Index, u8),
    Truncate(prop::sample::Index),
    /// A u64 field (count, length, dimension, offset) overwritten.
    Field(prop::sample::Index, u64),
}

fn arb_edit() -> impl Strategy<Value = Edit> {
    let huge = prop_oneof![
        Just(u64::MAX),
        Just(1u64 << 63),
        Just(u64::MAX / 3),
        Just(1u64 << 32),
        Just((1u64 << 61) + 1),
        0..300u64,
        any::<u64>(),
    ];
    prop_oneof![
        3 => (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(at, b)| Edit::Byte(at, b)),
        1 => any::<prop::sample::Index>().prop_map(Edit::Truncate),
        3 => (any::<prop::sample::Index>(), huge).prop_map(|(at, v)| Edit::Field(at, v)),
    ]
}

fn apply(out: &Out, edits: &[Edit]) -> Vec<u8> {
    let mut bytes = out.bytes.clone();
    for edit in edits {
        match edit {
            Edit::Byte(at, b) if !bytes.is_empty() => {
                let i = at.index(bytes.len());
                bytes[i] = *b;
            }
            Edit::Truncate(at) => bytes.truncate(at.index(bytes.len() + 1)),
            Edit::Field(at, v) => {
                let i = out.u64_fields[at.index(out.u64_fields.len())];
                if i + 8 <= bytes.len() {
                    bytes[i..i + 8].copy_from_slice(&v.to_le_bytes());
                }
            }
            Edit::Byte(..) => {}
        }
    }
    bytes
}

/// What the loaders do with an accepted file, checking what the parser promised: every
/// tensor's bytes inside the file and exactly what its type and shape need.
fn use_soundly(g: &Gguf, file_len: usize) {
    for t in g.tensors() {
        assert_eq!(g.tensor(&t.name).map(|f| &f.name), Some(&t.name));
        assert_eq!(t.elements() / t.ty.block_elements() * t.ty.block_bytes(), t.size, "{t:?}");
        assert_eq!(g.tensor_bytes(t).len() as u64, t.size);
        assert!(t.size <= file_len as u64);
        assert_eq!(g.tensor_f32(t).len() as u64, t.elements());
    }
    if let Ok(config) = hf::hf_config(g) {
        let _ = ModelConfig::from_hf(&config, g.path());
    }
    if let Ok(described) = info::describe(g) {
        let _ = described.render();
    }
    let _ = hf::tokenizer_json(g);
}

fn parse(bytes: Vec<u8>) -> Result<Gguf, super::GgufError> {
    Gguf::from_bytes(bytes, Path::new("fuzz.gguf"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(256), ..ProptestConfig::default() })]

    /// A valid file parses back to what was written.
    #[test]
    fn valid_files_parse_back(spec in arb_spec()) {
        let out = spec.write();
        let g = parse(out.bytes.clone()).unwrap_or_else(|e| panic!("{e}\n{spec:?}"));
        prop_assert_eq!(g.version, spec.version);
        prop_assert_eq!(g.metadata().len(), spec.metadata().len());
        prop_assert_eq!(g.get("llama.block_count").and_then(Value::as_u64), Some(1));
        prop_assert_eq!(g.tensors().len(), spec.tensors.len());
        for ((t, name), want) in g.tensors().iter().zip(TENSOR_NAMES).zip(&spec.tensors) {
            prop_assert_eq!(&t.name, name);
            prop_assert_eq!((t.ty, &t.dims), (want.ty, &want.dims()));
            let data = want.data();
            prop_assert_eq!(g.tensor_bytes(t), data.as_slice());
        }
        use_soundly(&g, out.bytes.len());
    }

    /// The same files damaged: an error, or a file every reader uses soundly.
    #[test]
    fn damaged_files_are_refused_or_sound(spec in arb_spec(), edits in proptest::collection::vec(arb_edit(), 1..5)) {
        let out = spec.write();
        let bytes = apply(&out, &edits);
        let len = bytes.len();
        if let Ok(g) = parse(bytes) {
            use_soundly(&g, len);
        }
    }
}

/// The coverage-guided target's seeds (`tests/fuzz/make_seeds.py`) are files the loaders
/// accept whole, so the fuzzer starts from deep inside them.
#[test]
fn fuzz_seeds_load() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fuzz/corpus/gguf_file");
    let mut seeds: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("seed-")))
        .collect();
    seeds.sort();
    assert!(seeds.len() >= 3, "{seeds:?}");
    for path in seeds {
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let len = bytes.len();
        let g = Gguf::from_bytes(bytes, &path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        use_soundly(&g, len);
        if g.architecture().is_some() {
            let config = hf::hf_config(&g).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            ModelConfig::from_hf(&config, &path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            hf::tokenizer_json(&g).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
    }
}
