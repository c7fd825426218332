use super::*;
use half::f16;
use proptest::prelude::*;

/// Writes GGUF bytes: metadata (key, type id, encoded value) and tensors (name, dims,
/// type, data), data aligned as the reader expects.
pub(crate) struct Writer {
    pub version: u32,
    pub alignment: u64,
    pub metadata: Vec<(String, u32, Vec<u8>)>,
    pub tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

pub(crate) fn gguf_string(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

impl Writer {
    pub fn new() -> Writer {
        Writer { version: 3, alignment: DEFAULT_ALIGNMENT, metadata: Vec::new(), tensors: Vec::new() }
    }

    pub fn meta_str(mut self, key: &str, value: &str) -> Writer {
        self.metadata.push((key.into(), 8, gguf_string(value)));
        self
    }

    pub fn meta_u32(mut self, key: &str, value: u32) -> Writer {
        self.metadata.push((key.into(), 4, value.to_le_bytes().to_vec()));
        self
    }

    pub fn meta_bool(mut self, key: &str, value: bool) -> Writer {
        self.metadata.push((key.into(), 7, vec![value.into()]));
        self
    }

    /// An array of values of GGUF type `ty`, each already encoded.
    pub fn meta_array(mut self, key: &str, ty: u32, values: &[Vec<u8>]) -> Writer {
        let mut out = ty.to_le_bytes().to_vec();
        out.extend_from_slice(&(values.len() as u64).to_le_bytes());
        values.iter().for_each(|v| out.extend_from_slice(v));
        self.metadata.push((key.into(), 9, out));
        self
    }

    pub fn meta_strs(self, key: &str, values: &[String]) -> Writer {
        self.meta_array(key, 8, &values.iter().map(|s| gguf_string(s)).collect::<Vec<_>>())
    }

    pub fn meta_f32s(self, key: &str, values: &[f32]) -> Writer {
        self.meta_array(key, 6, &values.iter().map(|v| v.to_le_bytes().to_vec()).collect::<Vec<_>>())
    }

    pub fn meta_i32s(self, key: &str, values: &[i32]) -> Writer {
        self.meta_array(key, 5, &values.iter().map(|v| v.to_le_bytes().to_vec()).collect::<Vec<_>>())
    }

    pub fn tensor(mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> Writer {
        self.tensors.push((name.into(), dims.to_vec(), ty, data));
        self
    }

    pub fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, ty, value) in &self.metadata {
            out.extend_from_slice(&gguf_string(key));
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(value);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            out.extend_from_slice(&gguf_string(name));
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.id().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len() as u64).next_multiple_of(self.alignment);
        }
        out.resize((out.len() as u64).next_multiple_of(self.alignment) as usize, 0);
        let start = out.len() as u64;
        for ((_, _, _, data), at) in self.tensors.iter().zip(offsets) {
            out.resize((start + at) as usize, 0);
            out.extend_from_slice(data);
        }
        out
    }
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn sample() -> Writer {
    let q8: Vec<u8> =
        [f16::from_f32(0.5).to_le_bytes().to_vec(), (0..32).map(|i| (i as i8 - 16) as u8).collect()].concat();
    Writer::new()
        .meta_str("general.architecture", "llama")
        .meta_u32("llama.block_count", 2)
        .tensor("norm", &[4], GgmlType::F32, f32_bytes(&[1.0, 2.0, 3.0, 4.0]))
        .tensor("emb", &[32, 1], GgmlType::Q8_0, q8)
}

fn parse(bytes: Vec<u8>) -> Result<Gguf, GgufError> {
    Gguf::from_bytes(bytes, Path::new("test.gguf"))
}

#[test]
fn reads_metadata_tensors_and_data() {
    let g = parse(sample().bytes()).expect("parse");
    assert_eq!(g.version, 3);
    assert_eq!(g.architecture(), Some("llama"));
    assert_eq!(g.get("llama.block_count").and_then(Value::as_u64), Some(2));
    let norm = g.tensor("norm").expect("norm");
    assert_eq!((norm.ty, norm.shape()), (GgmlType::F32, vec![4]));
    assert_eq!(g.tensor_f32(norm), vec![1.0, 2.0, 3.0, 4.0]);
    let emb = g.tensor("emb").expect("emb");
    assert_eq!(emb.shape(), vec![1, 32]);
    let values = g.tensor_f32(emb);
    assert_eq!(values[0], -8.0);
    assert_eq!(values[31], 7.5);
    assert_eq!(g.tensors().iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["norm", "emb"]);
}

#[test]
fn version_2_reads_and_others_are_refused() {
    let mut w = sample();
    w.version = 2;
    assert!(parse(w.bytes()).is_ok());
    for v in [1, 4, u32::MAX] {
        w.version = v;
        assert_eq!(parse(w.bytes()).unwrap_err(), GgufError::Version(v));
    }
}

#[test]
fn every_truncation_is_an_error_never_a_panic() {
    let bytes = sample().bytes();
    let header_end = bytes.len() - 4 * 4 - 34;
    for len in 0..bytes.len() {
        let result = parse(bytes[..len].to_vec());
        assert!(result.is_err(), "a file cut to {len} of {} bytes parsed", bytes.len());
        if len >= 4 && len < header_end {
            let e = result.unwrap_err().to_string();
            assert!(e.contains("truncated") || e.contains("cannot fit") || e.contains("past the end"), "{len}: {e}");
        }
    }
}

#[test]
fn damaged_headers_get_clear_errors() {
    let good = sample().bytes();
    let mut bad_magic = good.clone();
    bad_magic[..4].copy_from_slice(b"GGML");
    assert!(matches!(parse(bad_magic), Err(GgufError::BadMagic { .. })));

    // Huge counts are refused before any allocation.
    for at in [8, 16] {
        let mut huge = good.clone();
        huge[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = parse(huge).unwrap_err().to_string();
        assert!(e.contains("cannot fit"), "{e}");
    }
    // A string length past the end.
    let mut long_key = good.clone();
    long_key[24..32].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(parse(long_key).unwrap_err().to_string().contains("truncated"));

    let cases: Vec<(Writer, &str)> = vec![
        (sample().tensor("bad", &[4], GgmlType::F32, f32_bytes(&[0.0; 2])), "past the end"),
        (sample().tensor("ragged", &[33], GgmlType::Q8_0, vec![0; 68]), "blocks of 32"),
        (sample().tensor("zero", &[0, 4], GgmlType::F32, Vec::new()), "zero dimension"),
        (sample().tensor("huge", &[u64::MAX, 4], GgmlType::F32, Vec::new()), "overflow"),
        (sample().tensor("norm", &[4], GgmlType::F32, f32_bytes(&[0.0; 4])), "twice"),
        (sample().meta_str("general.architecture", "x"), "twice"),
        (sample().meta_str("general.alignment", "x"), "power of two"),
    ];
    for (w, expect) in cases {
        let e = parse(w.bytes()).unwrap_err().to_string();
        assert!(e.contains(expect), "expected {expect:?} in {e:?}");
    }

    // An unknown tensor type and an unknown value type.
    let mut w = sample();
    w.tensors[1].2 = GgmlType::F32;
    let mut bytes = w.bytes();
    let type_at = find_tensor_type_offset(&bytes, "emb");
    bytes[type_at..type_at + 4].copy_from_slice(&99u32.to_le_bytes());
    let e = parse(bytes).unwrap_err().to_string();
    assert!(e.contains("unsupported tensor type 99") && e.contains("Q4_K"), "{e}");
    let mut w = sample();
    w.metadata.push(("odd".into(), 42, Vec::new()));
    assert!(parse(w.bytes()).unwrap_err().to_string().contains("unknown value type 42"));
}

/// Tensor infos may not share data: each dequantizes to its own buffer on load, so N
/// infos over one blob made a file cost N times its size in memory: quadratic, a 1 MB
/// file of such infos (half ~60-byte infos, half Q4_0 data) would ask
/// `Checkpoint::from_gguf` for about 30 GB.
#[test]
fn overlapping_tensor_data_is_refused() {
    let w = sample().tensor("blk.0.attn_q.weight", &[32, 4], GgmlType::Q4_0, vec![0; 72]).tensor(
        "blk.1.attn_q.weight",
        &[32, 4],
        GgmlType::Q4_0,
        vec![0; 72],
    );
    let good = w.bytes();
    assert!(parse(good.clone()).is_ok(), "adjacent tensors parse");
    let offset_of = |bytes: &[u8], name: &str| find_tensor_type_offset(bytes, name) + 4;
    for (reuse, expect) in [(0u64, "overlaps"), (32, "overlaps")] {
        let mut bytes = good.clone();
        let first = offset_of(&bytes, "blk.0.attn_q.weight");
        let base = u64::from_le_bytes(bytes[first..first + 8].try_into().expect("8 bytes"));
        let at = offset_of(&bytes, "blk.1.attn_q.weight");
        bytes[at..at + 8].copy_from_slice(&(base + reuse).to_le_bytes());
        let e = parse(bytes).unwrap_err();
        assert!(
            matches!(&e, GgufError::Tensor { name, what } if name == "blk.1.attn_q.weight" && what.contains(expect)),
            "{e}"
        );
    }
}

/// Where the type id of tensor `name` sits in a [`Writer`]'s bytes.
fn find_tensor_type_offset(bytes: &[u8], name: &str) -> usize {
    let needle = gguf_string(name);
    let at = bytes.windows(needle.len()).rposition(|w| w == needle.as_slice()).expect("tensor name");
    let dims = u32::from_le_bytes(bytes[at + needle.len()..at + needle.len() + 4].try_into().expect("4 bytes"));
    at + needle.len() + 4 + 8 * dims as usize
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
    /// Random bytes, and random corruptions of a good file, never panic.
    #[test]
    fn arbitrary_bytes_never_panic(noise in proptest::collection::vec(any::<u8>(), 0..256),
                                   flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        let _ = parse([b"GGUF".as_slice(), &3u32.to_le_bytes(), &noise].concat());
        let mut bytes = sample().bytes();
        for (at, b) in flips {
            let i = at.index(bytes.len());
            bytes[i] = b;
        }
        if let Ok(g) = parse(bytes) {
            for t in g.tensors() {
                let _ = g.tensor_f32(t);
            }
        }
    }
}

// ---- block formats, against ggml's reference formulas written out by hand ----

fn h(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

#[test]
fn q4_0_and_q4_1_use_low_nibbles_first_then_high() {
    let mut b = h(2.0).to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let mut y = [0.0; 32];
    GgmlType::Q4_0.dequantize(&b, &mut y);
    for j in 0..16 {
        assert_eq!(y[j], (j as f32 - 8.0) * 2.0);
        assert_eq!(y[j + 16], ((15 - j) as f32 - 8.0) * 2.0);
    }
    let mut b = [h(0.5), h(-3.0)].concat();
    b.extend((0..16u8).map(|j| j | (j << 4)));
    GgmlType::Q4_1.dequantize(&b, &mut y);
    for j in 0..16 {
        assert_eq!((y[j], y[j + 16]), (j as f32 * 0.5 - 3.0, j as f32 * 0.5 - 3.0));
    }
}

#[test]
fn q5_takes_the_fifth_bit_of_value_j_from_bit_j_of_qh() {
    // Values 0..16 get bit j, values 16..32 bit j + 16 (as ggml's `>> (j + 12)` & 0x10).
    let qh: u32 = 0b1010_0000_0000_0001_1000_0000_0000_0011;
    let mut b = h(1.0).to_vec();
    b.extend(qh.to_le_bytes());
    b.extend([0x21u8; 16]);
    let mut y = [0.0; 32];
    GgmlType::Q5_0.dequantize(&b, &mut y);
    for (j, v) in y.iter().enumerate() {
        let nibble = if j < 16 { 1 } else { 2 };
        let fifth = (qh >> j) & 1;
        assert_eq!(*v, (nibble + 16 * fifth) as f32 - 16.0, "value {j}");
    }
    let mut b = [h(0.25), h(1.0)].concat();
    b.extend(qh.to_le_bytes());
    b.extend([0x21u8; 16]);
    GgmlType::Q5_1.dequantize(&b, &mut y);
    for (j, v) in y.iter().enumerate() {
        let nibble = if j < 16 { 1 } else { 2 };
        assert_eq!(*v, (nibble + 16 * ((qh >> j) & 1)) as f32 * 0.25 + 1.0, "value {j}");
    }
}

#[test]
fn edge_scales_zero_negative_zero_subnormal() {
    let subnormal = f16::from_bits(0x0001); // 2^-24
    for d in [f16::ZERO, f16::NEG_ZERO, subnormal, f16::MAX] {
        let mut b = d.to_le_bytes().to_vec();
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let mut y = [0.0; 32];
        GgmlType::Q8_0.dequantize(&b, &mut y);
        for (i, v) in y.iter().enumerate() {
            assert_eq!(*v, (i as f32 - 16.0) * d.to_f32());
        }
    }
}

/// ggml's `get_scale_min_k4`, written as in C.
fn reference_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// ggml's `dequantize_row_q4_K` for one block, written as in C (pointer walks).
fn reference_q4_k(x: &[u8]) -> Vec<f32> {
    let d = f16::from_le_bytes([x[0], x[1]]).to_f32();
    let min = f16::from_le_bytes([x[2], x[3]]).to_f32();
    let scales = &x[4..16];
    let mut q = &x[16..];
    let mut y = Vec::new();
    let mut is = 0;
    for _ in (0..256).step_by(64) {
        let (sc, m) = reference_scale_min(is, scales);
        let (d1, m1) = (d * sc as f32, min * m as f32);
        let (sc, m) = reference_scale_min(is + 1, scales);
        let (d2, m2) = (d * sc as f32, min * m as f32);
        y.extend(q[..32].iter().map(|&v| d1 * (v & 0xF) as f32 - m1));
        y.extend(q[..32].iter().map(|&v| d2 * (v >> 4) as f32 - m2));
        q = &q[32..];
        is += 2;
    }
    y
}

/// ggml's `dequantize_row_q6_K` for one block, written as in C.
fn reference_q6_k(x: &[u8]) -> Vec<f32> {
    let d = f16::from_le_bytes([x[208], x[209]]).to_f32();
    let (mut ql, mut qh, mut sc) = (&x[0..128], &x[128..192], &x[192..208]);
    let mut y = vec![0.0; 256];
    for n in (0..256).step_by(128) {
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            y[n + l] = d * sc[is] as i8 as f32 * q1 as f32;
            y[n + l + 32] = d * sc[is + 2] as i8 as f32 * q2 as f32;
            y[n + l + 64] = d * sc[is + 4] as i8 as f32 * q3 as f32;
            y[n + l + 96] = d * sc[is + 6] as i8 as f32 * q4 as f32;
        }
        ql = &ql[64..];
        qh = &qh[32..];
        sc = &sc[8..];
    }
    y
}

/// A finite f16 scale, edge values included.
fn scale() -> impl Strategy<Value = [u8; 2]> {
    prop_oneof![
        Just(f16::ZERO.to_le_bytes()),
        Just(f16::NEG_ZERO.to_le_bytes()),
        Just(f16::from_bits(1).to_le_bytes()),
        Just(f16::from_bits(0x03ff).to_le_bytes()),
        (-4.0f32..4.0).prop_map(|v| f16::from_f32(v).to_le_bytes()),
    ]
}

proptest! {
    #[test]
    fn k_quants_equal_ggml_reference(d in scale(), dmin in scale(), body in proptest::collection::vec(any::<u8>(), 208)) {
        let q4k = [d.as_slice(), &dmin, &body[..140]].concat();
        let mut y = vec![0.0; 256];
        GgmlType::Q4K.dequantize(&q4k, &mut y);
        prop_assert_eq!(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        reference_q4_k(&q4k).iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        let q6k = [body.as_slice(), &d].concat();
        GgmlType::Q6K.dequantize(&q6k, &mut y);
        prop_assert_eq!(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        reference_q6_k(&q6k).iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    }

    #[test]
    fn q8_0_and_nibble_formats_equal_the_formulas(d in scale(), m in scale(), body in proptest::collection::vec(any::<u8>(), 32)) {
        let (df, mf) = (f16::from_le_bytes(d).to_f32(), f16::from_le_bytes(m).to_f32());
        let mut y = [0.0; 32];
        GgmlType::Q8_0.dequantize(&[d.as_slice(), &body].concat(), &mut y);
        for j in 0..32 {
            prop_assert_eq!(y[j].to_bits(), (body[j] as i8 as f32 * df).to_bits());
        }
        GgmlType::Q4_1.dequantize(&[d.as_slice(), &m, &body[..16]].concat(), &mut y);
        for j in 0..16 {
            prop_assert_eq!(y[j].to_bits(), ((body[j] & 15) as f32 * df + mf).to_bits());
            prop_assert_eq!(y[j + 16].to_bits(), ((body[j] >> 4) as f32 * df + mf).to_bits());
        }
    }
}

/// The shared SmolLM2 file (Q4_1 linears, Q8_0 embedding, F32 norms).
#[test]
fn reads_the_shared_smollm2_file() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let g = Gguf::open(&path).expect("the shared model parses");
    assert_eq!(g.architecture(), Some("llama"));
    assert_eq!(g.get("llama.block_count").and_then(Value::as_u64), Some(30));
    assert_eq!(g.get("llama.embedding_length").and_then(Value::as_u64), Some(576));
    assert_eq!(g.get("tokenizer.ggml.model").and_then(Value::as_str), Some("gpt2"));
    let emb = g.tensor("token_embd.weight").expect("embedding");
    assert_eq!((emb.ty, emb.shape()), (GgmlType::Q8_0, vec![49152, 576]));
    let q = g.tensor("blk.0.attn_q.weight").expect("attn_q");
    assert_eq!((q.ty, q.shape()), (GgmlType::Q4_1, vec![576, 576]));
    assert_eq!(g.tensor("blk.0.attn_norm.weight").map(|t| t.ty), Some(GgmlType::F32));
    let values = g.tensor_f32(q);
    assert!(values.iter().all(|v| v.is_finite()));
    let rms = (values.iter().map(|v| v * v).sum::<f32>() / values.len() as f32).sqrt();
    assert!((0.005..1.0).contains(&rms), "attn_q rms {rms}");
}

/// llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`):
/// `w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)`.
fn converter_permute(w: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let rows = w.len() / cols;
    let half = rows / heads / 2;
    let mut out = Vec::with_capacity(w.len());
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let src = h * 2 * half + j * half + i;
                out.extend_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

#[test]
fn unpermute_undoes_the_converters_q_k_permutation() {
    for (heads, head_dim, cols) in [(1, 2, 1), (3, 8, 5), (9, 64, 3)] {
        let hf: Vec<f32> = (0..heads * head_dim * cols).map(|v| v as f32).collect();
        let mut values = converter_permute(&hf, heads, cols);
        if head_dim > 2 {
            assert_ne!(values, hf, "the permutation moves rows");
        }
        hf::unpermute_rows(&mut values, heads, cols).expect("unpermute");
        assert_eq!(values, hf);
    }
    let mut odd = vec![0.0; 3 * 4];
    assert!(hf::unpermute_rows(&mut odd, 2, 4).is_err(), "3 rows do not split into 2 heads");
}

/// The GGUF vocabulary tokenizes as llama.cpp does: ids recorded from llama.cpp's own
/// tokenizer on the same file (tests/fixtures/tokenizer/make-smollm2-ids.py says how)
/// for 240 strings — ASCII, digits, whitespace runs, code, accents, CJK, emoji, special
/// tokens — and every string survives decode(encode(s)).
#[test]
fn smollm2_vocabulary_tokenizes_as_llama_cpp() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let fixture = root.join("tests/fixtures/tokenizer/smollm2-ids.json");
    let text = std::fs::read_to_string(&fixture).expect("the fixture");
    let fixture: serde_json::Value = serde_json::from_str(&text).expect("fixture JSON");
    let model = root.join("../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let tok = crate::tokenizer::TextTokenizer::from_gguf(&model).expect("tokenizer");
    let cases = fixture["cases"].as_array().expect("cases");
    assert!(cases.len() >= 200);
    let mut wrong = Vec::new();
    for case in cases {
        let s = case["text"].as_str().expect("text");
        let want: Vec<u32> =
            case["ids"].as_array().expect("ids").iter().filter_map(|v| v.as_u64()).map(|v| v as u32).collect();
        let got = tok.encode(s, false).expect("encode");
        if got != want {
            wrong.push(format!("{s:?}: llama.cpp {want:?}, ours {got:?}"));
        }
        assert_eq!(tok.decode(&got).expect("decode"), s, "decode(encode(s)) == s");
    }
    assert!(wrong.is_empty(), "{} of {} strings differ:\n{}", wrong.len(), cases.len(), wrong.join("\n"));
}

/// A SentencePiece-style (`llama`) vocabulary tokenizes as llama.cpp does: a tiny GGUF
/// with a SentencePiece BPE vocabulary trained for the test, and ids recorded from
/// llama.cpp's own tokenizer on that file (tests/fixtures/tokenizer/make-llama-spm.py
/// says how) for 251 strings — ASCII, digits, whitespace runs, code, accents, CJK,
/// emoji and other bytes outside the vocabulary, special tokens in the text.
#[test]
fn llama_spm_vocabulary_tokenizes_as_llama_cpp() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer");
    let text = std::fs::read_to_string(dir.join("llama-spm-ids.json")).expect("the fixture");
    let fixture: serde_json::Value = serde_json::from_str(&text).expect("fixture JSON");
    let model = dir.join("llama-spm.gguf");
    let tok = crate::tokenizer::TextTokenizer::from_gguf(&model).expect("tokenizer");
    let vocab = spm::SpmVocab::from_gguf(&Gguf::open(&model).expect("the GGUF")).expect("vocabulary");
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array().expect("ids").iter().filter_map(serde_json::Value::as_u64).map(|v| v as u32).collect()
    };
    let cases = fixture["cases"].as_array().expect("cases");
    assert!(cases.len() >= 200);
    let (mut wrong, mut round_trips) = (Vec::new(), 0);
    for case in cases {
        let s = case["text"].as_str().expect("text");
        let (want, want_no_bos) = (ids(&case["llama_cpp"]), ids(&case["llama_cpp_no_bos"]));
        let got_no_bos = tok.encode(s, false).expect("encode");
        let got = tok.encode(s, true).expect("encode");
        // Tessera adds no second BOS to a text that starts with one (llama.cpp does).
        let want_with_bos = if want.starts_with(&[1, 1]) { &want[1..] } else { &want[..] };
        if got_no_bos != want_no_bos || got != want_with_bos {
            wrong.push(format!("{s:?}: llama.cpp {want:?}, ours {got:?}"));
        }
        // Text that is all pieces round-trips; special tokens get a space after them and
        // control tokens render nothing, and a literal ▁ is a space (as in llama.cpp).
        let special =
            got_no_bos.iter().any(|&id| !matches!(vocab.kind(id), Some(spm::TokenKind::Normal | spm::TokenKind::Byte)));
        if !special && !s.contains('▁') {
            assert_eq!(tok.decode(&got).expect("decode"), s, "decode(encode({s:?}))");
            round_trips += 1;
        }
        let mut stream = tok.stream_decoder();
        let mut streamed = String::new();
        for &id in &got {
            streamed.push_str(&stream.push(id).expect("push").unwrap_or_default());
        }
        streamed.push_str(&stream.finish().expect("finish").unwrap_or_default());
        assert_eq!(streamed, tok.decode(&got).expect("decode"), "streamed {s:?}");
    }
    assert!(wrong.is_empty(), "{} of {} strings differ:\n{}", wrong.len(), cases.len(), wrong.join("\n"));
    assert!(round_trips >= 170, "only {round_trips} strings round-trip");
}

/// The fixture's second reference: the sentencepiece library on the model the vocabulary
/// was trained as agrees with llama.cpp except where the text spells a special token
/// (sentencepiece tokenizes `<s>` as text and knows nothing of the added tokens).
#[test]
fn sentencepiece_and_llama_cpp_differ_only_on_special_token_text() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer");
    let text = std::fs::read_to_string(dir.join("llama-spm-ids.json")).expect("the fixture");
    let fixture: serde_json::Value = serde_json::from_str(&text).expect("fixture JSON");
    let specials = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "[[TOOL]]"];
    let mut differ = 0;
    for case in fixture["cases"].as_array().expect("cases") {
        let s = case["text"].as_str().expect("text");
        let same = case["llama_cpp"] == case["sentencepiece"];
        assert_eq!(same, !specials.iter().any(|t| s.contains(t)), "{s:?}: {case}");
        differ += usize::from(!same);
    }
    assert!(differ > 20, "the fixture exercises special tokens ({differ} strings)");
}

/// BOS per `tokenizer.ggml.add_bos_token`, EOS from the file, and bad vocabulary metadata
/// refused by the tokenizer with the file named.
#[test]
fn llama_spm_bos_eos_and_refusals() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer");
    let tok = crate::tokenizer::TextTokenizer::from_gguf(&dir.join("llama-spm.gguf")).expect("tokenizer");
    assert_eq!((tok.bos_id(), tok.eos_ids()), (Some(1), vec![2]));
    assert_eq!(tok.id_to_token(1).as_deref(), Some("<s>"));
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2001));
    assert_eq!(tok.vocab_size(), 2003);
    let hi = tok.encode("hi", true).expect("encode");
    assert_eq!(hi[0], 1);
    assert_eq!(&hi[1..], tok.encode("hi", false).expect("encode"));
    assert_eq!(tok.encode("<s>hi", true).expect("encode").iter().filter(|&&id| id == 1).count(), 1);
    assert_eq!(tok.decode(&hi).expect("decode"), "hi");
    // Control tokens render nothing; ids past the vocabulary decode to nothing.
    assert_eq!(tok.decode(&[1, 2, 2000, u32::MAX]).expect("decode"), "");
    assert!(tok.chat_template().is_some_and(|t| t.contains("[INST]")));

    let bytes = std::fs::read(dir.join("llama-spm.gguf")).expect("the GGUF");
    let g = Gguf::from_bytes(bytes, Path::new("llama-spm.gguf")).expect("parse");
    let tmp = std::env::temp_dir().join(format!("tessera-spm-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).expect("tempdir");
    let rewrite = |name: &str, edit: &dyn Fn(&mut Writer)| {
        let mut w = Writer::new();
        for (key, value) in g.metadata() {
            if key != "general.alignment" {
                w.metadata.push((key.clone(), 0, Vec::new()));
                encode_value(value, w.metadata.last_mut().expect("pushed"));
            }
        }
        for t in g.tensors() {
            w = w.tensor(&t.name, &t.dims, t.ty, g.tensor_bytes(t).to_vec());
        }
        edit(&mut w);
        let path = tmp.join(name);
        std::fs::write(&path, w.bytes()).expect("write");
        path
    };
    let no_bos = rewrite("no-bos.gguf", &|w| {
        w.metadata.retain(|(k, _, _)| k != "tokenizer.ggml.add_bos_token");
        w.metadata.push(("tokenizer.ggml.add_bos_token".into(), 7, vec![0]));
    });
    let t = crate::tokenizer::TextTokenizer::from_gguf(&no_bos).expect("tokenizer");
    assert_eq!(t.bos_id(), None);
    assert_eq!(t.encode("hi", true).expect("encode"), tok.encode("hi", false).expect("encode"));
    let short_scores = rewrite("short-scores.gguf", &|w| {
        let (_, _, v) = w.metadata.iter_mut().find(|(k, _, _)| k == "tokenizer.ggml.scores").expect("scores");
        // One score (type u32, count u64, one f32) for 2003 tokens.
        v[4..12].copy_from_slice(&1u64.to_le_bytes());
        v.truncate(16);
    });
    let err = crate::tokenizer::TextTokenizer::from_gguf(&short_scores).expect_err("refused").to_string();
    assert!(err.contains("short-scores.gguf") && err.contains("1 scores for 2003 tokens"), "{err}");
    let _ = std::fs::remove_dir_all(&tmp);
}

/// Encodes a parsed metadata value back (type id and bytes), for rewriting a file.
fn encode_value(value: &Value, slot: &mut (String, u32, Vec<u8>)) {
    fn body(value: &Value) -> (u32, Vec<u8>) {
        match value {
            Value::U8(v) => (0, vec![*v]),
            Value::I8(v) => (1, v.to_le_bytes().to_vec()),
            Value::U16(v) => (2, v.to_le_bytes().to_vec()),
            Value::I16(v) => (3, v.to_le_bytes().to_vec()),
            Value::U32(v) => (4, v.to_le_bytes().to_vec()),
            Value::I32(v) => (5, v.to_le_bytes().to_vec()),
            Value::F32(v) => (6, v.to_le_bytes().to_vec()),
            Value::Bool(v) => (7, vec![u8::from(*v)]),
            Value::Str(s) => (8, gguf_string(s)),
            Value::Array(items) => {
                let ty = items.first().map_or(4, |v| body(v).0);
                let mut out = ty.to_le_bytes().to_vec();
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                items.iter().for_each(|v| out.extend_from_slice(&body(v).1));
                (9, out)
            }
            Value::U64(v) => (10, v.to_le_bytes().to_vec()),
            Value::I64(v) => (11, v.to_le_bytes().to_vec()),
            Value::F64(v) => (12, v.to_le_bytes().to_vec()),
        }
    }
    (slot.1, slot.2) = body(value);
}

/// `rope_freqs.weight` as llama.cpp's converter writes it for Llama 3 (`LlamaModel`'s
/// `generate_extra_tensors`), in f32 as stored.
fn converter_rope_factors(theta: f64, head_dim: usize, factor: f64, low: f64, high: f64, old: f64) -> Vec<f32> {
    let (low_wl, high_wl) = (old / low, old / high);
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64);
            let wl = 2.0 * std::f64::consts::PI / freq;
            if wl < high_wl {
                1.0
            } else if wl > low_wl {
                factor as f32
            } else {
                let smooth = (old / wl - low) / (high - low);
                (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
            }
        })
        .collect()
}

#[test]
fn llama3_rope_scaling_is_recovered_from_rope_freqs() {
    // Llama 3.1 (8B, 70B) and Llama 3.2 (1B, 3B): theta 500000, head_dim 128 / 64.
    for (head_dim, factor) in [(128, 8.0), (64, 32.0), (128, 32.0)] {
        let factors = converter_rope_factors(500_000.0, head_dim, factor, 1.0, 4.0, 8192.0);
        let s = hf::llama3_from_rope_factors(&factors, 500_000.0, head_dim).unwrap().expect("scaled");
        assert_eq!((s.rope_type.as_str(), s.factor), ("llama3", factor as f32));
        // The boundaries (old / low, old / high) are what shape the factors.
        let (lo_wl, hi_wl) = (8192.0 / s.low_freq_factor, 8192.0 / s.high_freq_factor);
        assert!((lo_wl / 8192.0 - 1.0).abs() < 1e-3 && (hi_wl / 2048.0 - 1.0).abs() < 1e-3, "{s:?}");
    }
    // No scaling at all.
    assert!(hf::llama3_from_rope_factors(&[1.0; 32], 10_000.0, 64).unwrap().is_none());
    // Factors of another shape are refused, not approximated.
    let mut bent = converter_rope_factors(500_000.0, 128, 8.0, 1.0, 4.0, 8192.0);
    let mid = bent.iter().position(|&r| r > 1.0 && r < 8.0).unwrap();
    bent[mid] *= 1.2;
    let e = hf::llama3_from_rope_factors(&bent, 500_000.0, 128).unwrap_err();
    assert!(e.contains("Llama 3's scaling"), "{e}");
    assert!(hf::llama3_from_rope_factors(&[1.0, f32::NAN], 10_000.0, 4).is_err());
    assert!(hf::llama3_from_rope_factors(&[0.5, 1.0], 10_000.0, 4).is_err());
}
