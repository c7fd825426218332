//! Checkpoint tensors from safetensors files (single or sharded with an index),
//! memory-mapped and validated: every tensor's dtype, shape and byte range are checked
//! before anything is handed to a device.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use memmap2::Mmap;

use crate::device::{Buffer, Device};
use crate::dtype::{DType, DTypeExt, GgmlType, GgmlTypeExt};
use crate::error::{BackendError, Result};
use crate::mmap::{Placement, huge_page_eligible, map_file};

/// Where one tensor lives.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub name: String,
    /// As stored: a float type (safetensors, GGUF) or a ggml block format (GGUF).
    pub ty: GgmlType,
    pub shape: Vec<usize>,
    file: usize,
    range: Range<usize>,
}

/// All tensors of a checkpoint directory, memory-mapped (for a GGUF file: mapped too,
/// quantized tensors as they are, except llama Q/K rows, which are copied un-permuted).
pub struct Checkpoint {
    dir: PathBuf,
    maps: Vec<Storage>,
    tensors: HashMap<String, TensorEntry>,
}

/// Where a checkpoint's tensor bytes live.
enum Storage {
    /// A file's map, and whether the kernel may back it with huge pages (read from
    /// /proc at most once, when a placement first asks).
    Map(Arc<Mmap>, OnceLock<Option<bool>>),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Map(m, _) => m,
            Storage::Owned(v) => v,
        }
    }
}

#[derive(serde::Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors`, or the shards listed in
    /// `dir/model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        if crate::gguf::is_model_file(dir) {
            return Checkpoint::from_gguf(dir);
        }
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if single.is_file() {
            vec![single]
        } else if index.is_file() {
            let text = std::fs::read_to_string(&index).map_err(|e| BackendError::io(&index, e))?;
            let parsed: ShardIndex = serde_json::from_str(&text)
                .map_err(|e| BackendError::Safetensors { path: index.clone(), reason: e.to_string() })?;
            let mut names: Vec<&String> = parsed.weight_map.values().collect();
            names.sort();
            names.dedup();
            for name in &names {
                if name.contains('/') || name.contains('\\') || name.starts_with('.') {
                    return Err(BackendError::Safetensors {
                        path: index.clone(),
                        reason: format!("shard name {name:?} must be a file name inside the checkpoint directory"),
                    });
                }
            }
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            return Err(BackendError::io(
                &single,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "neither model.safetensors nor model.safetensors.index.json exists",
                ),
            ));
        };
        let mut maps = Vec::with_capacity(files.len());
        let mut tensors = HashMap::new();
        for (file_idx, path) in files.iter().enumerate() {
            let map = map_file(path)?;
            let st_err = |reason: String| BackendError::Safetensors { path: path.clone(), reason };
            let st = safetensors::SafeTensors::deserialize(&map[..]).map_err(|e| st_err(e.to_string()))?;
            let base = map.as_ptr() as usize;
            for (name, view) in st.tensors() {
                let dtype = DType::from_safetensors(view.dtype()).ok_or_else(|| BackendError::TensorDtype {
                    dir: dir.to_path_buf(),
                    name: name.clone(),
                    found: format!("{:?}", view.dtype()),
                })?;
                let start = view.data().as_ptr() as usize - base;
                let entry = TensorEntry {
                    name: name.clone(),
                    ty: dtype.ggml(),
                    shape: view.shape().to_vec(),
                    file: file_idx,
                    range: start..start + view.data().len(),
                };
                if tensors.insert(name.clone(), entry).is_some() {
                    return Err(st_err(format!("tensor {name:?} appears in more than one shard")));
                }
            }
            maps.push(Storage::Map(map, OnceLock::new()));
        }
        Ok(Checkpoint { dir: dir.to_path_buf(), maps, tensors })
    }

    /// The tensors of a GGUF file under their Hugging Face names and in Hugging Face
    /// layout (llama Q/K rows un-permuted; see [`crate::gguf::hf`]), each in the type the
    /// file stores: quantized tensors stay quantized.
    pub fn from_gguf(path: &Path) -> Result<Checkpoint> {
        use crate::gguf::{Gguf, GgufError, hf};
        let g = Gguf::open(path)?;
        let fail = |reason: GgufError| BackendError::Gguf { path: path.to_path_buf(), reason };
        let config = hf::hf_config(&g).map_err(fail)?;
        let map = g.map().ok_or_else(|| fail(GgufError::Tensor { name: "*".into(), what: "not mapped".into() }))?;
        let mut maps = vec![Storage::Map(map.clone(), OnceLock::new())];
        let mut tensors = HashMap::new();
        for info in g.tensors() {
            let Some(name) = hf::hf_name(&info.name) else { continue };
            let mut entry = TensorEntry {
                name: name.clone(),
                ty: info.ty,
                shape: info.shape(),
                file: 0,
                range: g.tensor_range(info),
            };
            if let Some(heads) = hf::permuted_heads(&g, info, &config) {
                let cols = if info.dims.len() > 1 { info.dims[0] as usize } else { 1 };
                let row_bytes = info.ty.row_bytes(cols).ok_or_else(|| {
                    fail(GgufError::Tensor { name: info.name.clone(), what: "rows are not whole blocks".into() })
                })?;
                let mut bytes = g.tensor_bytes(info).to_vec();
                hf::unpermute_rows(&mut bytes, heads, row_bytes)
                    .map_err(|what| fail(GgufError::Tensor { name: info.name.clone(), what }))?;
                entry.file = maps.len();
                entry.range = 0..bytes.len();
                maps.push(Storage::Owned(bytes));
            }
            tensors.insert(name, entry);
        }
        Ok(Checkpoint { dir: path.to_path_buf(), maps, tensors })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Bytes stored of the tensors whose names start with `prefix`.
    pub fn stored_bytes(&self, prefix: &str) -> u64 {
        self.tensors.values().filter(|e| e.name.starts_with(prefix)).map(|e| e.range.len() as u64).sum()
    }

    /// The tensor `name`, which must have exactly `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<&TensorEntry> {
        let entry = self
            .tensors
            .get(name)
            .ok_or_else(|| BackendError::MissingTensor { dir: self.dir.clone(), name: name.to_string() })?;
        if entry.shape != shape {
            return Err(BackendError::TensorShape {
                dir: self.dir.clone(),
                name: name.to_string(),
                found: entry.shape.clone(),
                expected: shape.to_vec(),
            });
        }
        Ok(entry)
    }

    /// The raw little-endian bytes of a tensor, straight from the map.
    pub fn bytes(&self, entry: &TensorEntry) -> &[u8] {
        &self.maps[entry.file].bytes()[entry.range.clone()]
    }

    /// The tensor converted (dequantized) to f32 on the host.
    pub fn to_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let entry = self.get(name, shape)?;
        Ok(entry_to_f32(self.bytes(entry), entry.ty))
    }

    /// Puts a tensor on `device` as `ty`: as stored when that is `ty` (when the device
    /// shares host memory and `placement` keeps the weights in the file's map, the map
    /// itself becomes the buffer: no copy), else converted, dequantized or quantized
    /// (per row of the last dimension; see [`tessera_quant::quantize`]).
    pub fn upload(
        &self,
        device: &Device,
        name: &str,
        shape: &[usize],
        ty: GgmlType,
        placement: Placement,
    ) -> Result<Buffer> {
        let entry = self.get(name, shape)?;
        let bytes = self.bytes(entry);
        if entry.ty == ty {
            let aligned = entry.range.start.is_multiple_of(ty.block_bytes().min(4) as usize);
            if let Storage::Map(map, eligible) = &self.maps[entry.file]
                && device.info().host_memory_shared
                && aligned
                && placement.keeps(|| *eligible.get_or_init(|| huge_page_eligible(&map[..])))
            {
                return device.wrap_host(map.clone(), entry.range.clone());
            }
            return device.upload(bytes);
        }
        let values = entry_to_f32(bytes, entry.ty);
        match ty.float() {
            Some(dtype) => device.upload(&f32_to_bytes(&values, dtype)),
            None => {
                let cols = shape.last().copied().unwrap_or(1);
                let out_bytes = ty.row_bytes(cols).map(|r| r * (values.len() / cols.max(1)));
                let mut out = vec![0u8; out_bytes.unwrap_or(0)];
                if out_bytes.is_none() || tessera_quant::quantize(ty, &values, &mut out).is_err() {
                    return Err(BackendError::Quantize {
                        name: name.to_string(),
                        reason: format!("rows of {cols} values are not whole {ty} blocks of {}", ty.block_elements()),
                    });
                }
                device.upload(&out)
            }
        }
    }
}

/// Which part of a 2-D tensor `[rows, cols]` a shard loads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Whole,
    /// Rows `r` (a row-split linear: some of its outputs).
    Rows(Range<usize>),
    /// Columns `c` of every row (a column-split linear: some of its inputs).
    Cols(Range<usize>),
}

impl Checkpoint {
    /// [`upload`](Self::upload) of part of a tensor `[rows, cols]` (or a vector, split
    /// as rows). Bytes stored as `ty` are sliced as stored: a column range must then
    /// start and end on a block of `ty`, so the part's blocks are the whole tensor's.
    /// Other tensors are converted first and sliced after, as `upload` converts them.
    pub fn upload_part(
        &self,
        device: &Device,
        name: &str,
        shape: &[usize],
        ty: GgmlType,
        placement: Placement,
        part: &Part,
    ) -> Result<Buffer> {
        if *part == Part::Whole {
            return self.upload(device, name, shape, ty, placement);
        }
        let entry = self.get(name, shape)?;
        let cols = if shape.len() > 1 { shape[shape.len() - 1] } else { 1 };
        let rows = shape.iter().product::<usize>() / cols.max(1);
        let bad = |what: String| BackendError::Shard(format!("tensor {name:?} {shape:?}: {what}"));
        let range = match part {
            Part::Rows(r) | Part::Cols(r) => r.clone(),
            Part::Whole => 0..0,
        };
        let limit = if matches!(part, Part::Rows(_)) { rows } else { cols };
        if range.is_empty() || range.end > limit {
            return Err(bad(format!("{part:?} is outside its {limit}")));
        }
        let bytes = self.bytes(entry);
        if entry.ty == ty {
            let row_bytes = ty.row_bytes(cols).ok_or_else(|| bad(format!("rows are not whole {ty} blocks")))?;
            return match part {
                Part::Rows(r) => device.upload(&bytes[r.start * row_bytes..r.end * row_bytes]),
                _ => {
                    let per_block = ty.block_elements() as usize;
                    if !range.start.is_multiple_of(per_block) || !range.end.is_multiple_of(per_block) {
                        return Err(bad(format!(
                            "columns {range:?} do not start and end on {ty} blocks of {per_block}"
                        )));
                    }
                    let (from, to) = (range.start / per_block, range.end / per_block);
                    let block = ty.block_bytes() as usize;
                    let mut out = Vec::with_capacity(rows * (to - from) * block);
                    for row in bytes.chunks_exact(row_bytes) {
                        out.extend_from_slice(&row[from * block..to * block]);
                    }
                    device.upload(&out)
                }
            };
        }
        let values = entry_to_f32(bytes, entry.ty);
        let (values, part_cols) = match part {
            Part::Rows(r) => (values[r.start * cols..r.end * cols].to_vec(), cols),
            _ => (values.chunks_exact(cols).flat_map(|row| &row[range.clone()]).copied().collect(), range.len()),
        };
        match ty.float() {
            Some(dtype) => device.upload(&f32_to_bytes(&values, dtype)),
            None => {
                let out_bytes = ty.row_bytes(part_cols).map(|r| r * (values.len() / part_cols.max(1)));
                let mut out = vec![0u8; out_bytes.unwrap_or(0)];
                if out_bytes.is_none() || tessera_quant::quantize(ty, &values, &mut out).is_err() {
                    return Err(BackendError::Quantize {
                        name: name.to_string(),
                        reason: format!(
                            "rows of {part_cols} values are not whole {ty} blocks of {}",
                            ty.block_elements()
                        ),
                    });
                }
                device.upload(&out)
            }
        }
    }
}

/// A tensor's bytes of type `ty` as f32 values (float types converted, block formats
/// dequantized).
pub fn entry_to_f32(bytes: &[u8], ty: GgmlType) -> Vec<f32> {
    match ty.float() {
        Some(dtype) => convert_to_f32(bytes, dtype),
        None => {
            let n = bytes.len() / ty.block_bytes() as usize * ty.block_elements() as usize;
            let mut out = vec![0.0; n];
            ty.dequantize(bytes, &mut out);
            out
        }
    }
}

/// Little-endian elements of `from` to f32.
pub fn convert_to_f32(bytes: &[u8], from: DType) -> Vec<f32> {
    match from {
        DType::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        DType::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::Bf16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
    }
}

/// f32 values as little-endian bytes of `to` (round to nearest even).
pub fn f32_to_bytes(values: &[f32], to: DType) -> Vec<u8> {
    match to {
        DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => values.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect(),
        DType::Bf16 => values.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect(),
    }
}

/// Bounded fuzzing of [`Checkpoint::open`] (CI): checkpoint files come from whoever
/// published the model. Inputs are safetensors files written here — a JSON header of
/// tensors, then their bytes — with a field of one tensor replaced by a hostile value
/// (a dtype we do not serve, a shape or offsets at 0, -1, 2^32, 2^63, 2^64, 1e300,
/// reversed or overlapping offsets), a wrong header length, and bytes flipped, cut or
/// inserted; and shard indexes naming files outside the directory. Opening must refuse
/// with an error, never panic; an accepted checkpoint's every tensor lies inside the
/// map with exactly the bytes its dtype and shape need. The coverage-guided target is
/// `tests/fuzz/fuzz_targets/safetensors_header.rs`.
#[cfg(test)]
mod fuzz {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::*;

    /// A directory of its own for one test, removed when the test ends.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Scratch {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!("tessera-weights-fuzz-{tag}-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
            Scratch(dir)
        }

        /// Leaves exactly these files in the directory.
        fn write(&self, files: &[(&str, &[u8])]) {
            for name in ["model.safetensors", "model.safetensors.index.json", "shard.safetensors"] {
                let _ = std::fs::remove_file(self.0.join(name));
            }
            for (name, bytes) in files {
                let path = self.0.join(name);
                std::fs::write(&path, bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            }
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[derive(Debug, Clone)]
    struct Tensor {
        name: String,
        dtype: DType,
        shape: Vec<usize>,
    }

    fn arb_tensors() -> impl Strategy<Value = Vec<Tensor>> {
        let dtype = prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::Bf16)];
        let tensor = (dtype, proptest::collection::vec(0..5usize, 0..4)).prop_map(|(dtype, shape)| Tensor {
            name: String::new(),
            dtype,
            shape,
        });
        proptest::collection::vec(tensor, 0..4).prop_map(|mut tensors| {
            for (i, t) in tensors.iter_mut().enumerate() {
                t.name = format!("model.layers.{i}.weight");
            }
            tensors
        })
    }

    /// The valid header (as JSON, to be edited) and data section of `tensors`.
    fn valid_file(tensors: &[Tensor], fill: u8) -> (Value, Vec<u8>) {
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), json!({"format": "pt"}));
        let mut data = Vec::new();
        for t in tensors {
            let len = t.shape.iter().product::<usize>() * t.dtype.size_bytes();
            let start = data.len();
            data.extend((0..len).map(|i| fill.wrapping_add(i as u8)));
            header.insert(
                t.name.clone(),
                json!({"dtype": t.dtype.safetensors_name(), "shape": t.shape, "data_offsets": [start, data.len()]}),
            );
        }
        (Value::Object(header), data)
    }

    fn assemble(header: &[u8], data: &[u8], declared: Option<u64>) -> Vec<u8> {
        let mut file = declared.unwrap_or(header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header);
        file.extend_from_slice(data);
        file
    }

    /// JSON values where a dtype, a shape, offsets or a whole tensor entry belong.
    fn hostile_value() -> impl Strategy<Value = Value> {
        let big = |s: &str| serde_json::from_str::<Value>(s).unwrap_or(Value::Null);
        prop_oneof![
            Just(json!(null)),
            Just(json!(0)),
            Just(json!(-1)),
            Just(json!(1e300)),
            Just(json!(u64::MAX)),
            Just(big("18446744073709551616")),
            Just(json!("F8_E4M3")),
            Just(json!("F4")),
            Just(json!("BOOL")),
            Just(json!("I64")),
            Just(json!("F64")),
            Just(json!("")),
            Just(json!([])),
            Just(json!([0])),
            Just(json!([-1])),
            Just(json!([1u64 << 32, 1u64 << 32])),
            Just(json!([u64::MAX, 2])),
            Just(json!([1u64 << 63, 1u64 << 63, 4])),
            Just(json!([0, u64::MAX])),
            Just(json!([u64::MAX, u64::MAX])),
            Just(json!([8, 0])),
            Just(json!([0, 0])),
            Just(json!([0, 1])),
            Just(json!([0, 4, 8])),
            Just(json!([1e300, 2])),
            Just(json!({})),
            Just(json!({"dtype": "F32", "shape": [1]})),
            Just(json!({"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1})),
            Just(json!("\u{0}")),
        ]
    }

    #[derive(Debug, Clone)]
    enum Edit {
        /// Sets field `field` of the `tensor`-th entry (modulo their count; the metadata
        /// entry included) to a hostile value.
        Field {
            tensor: usize,
            field: usize,
            value: Value,
        },
        /// A header length other than the header's.
        Declared(u64),
        Flip(usize, u8),
        Cut(usize),
        Insert(usize, Vec<u8>),
    }

    const TENSOR_FIELDS: &[&str] = &["dtype", "shape", "data_offsets", ""];

    fn arb_edit() -> impl Strategy<Value = Edit> {
        prop_oneof![
            6 => (any::<usize>(), 0..TENSOR_FIELDS.len(), hostile_value())
                .prop_map(|(tensor, field, value)| Edit::Field { tensor, field, value }),
            2 => prop_oneof![
                Just(0u64), Just(1), Just(2), Just(100_000_001), Just(1 << 63), Just(u64::MAX), any::<u64>()
            ].prop_map(Edit::Declared),
            1 => (any::<usize>(), 1..=255u8).prop_map(|(at, x)| Edit::Flip(at, x)),
            1 => any::<usize>().prop_map(Edit::Cut),
            1 => (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..8)).prop_map(|(at, b)| Edit::Insert(at, b)),
        ]
    }

    fn edited_file(tensors: &[Tensor], edits: &[Edit]) -> Vec<u8> {
        let (mut header, data) = valid_file(tensors, 7);
        let mut declared = None;
        if let Value::Object(entries) = &mut header {
            let names: Vec<String> = entries.keys().cloned().collect();
            for edit in edits {
                match edit {
                    Edit::Field { tensor, field, value } if !names.is_empty() => {
                        let name = &names[tensor % names.len()];
                        match (TENSOR_FIELDS[*field], entries.get_mut(name)) {
                            ("", _) => {
                                entries.insert(name.clone(), value.clone());
                            }
                            (key, Some(Value::Object(entry))) => {
                                entry.insert(key.to_owned(), value.clone());
                            }
                            _ => {}
                        }
                    }
                    Edit::Declared(n) => declared = Some(*n),
                    _ => {}
                }
            }
        }
        let header = serde_json::to_vec(&header).unwrap_or_default();
        let mut file = assemble(&header, &data, declared);
        for edit in edits {
            let n = file.len().max(1);
            match edit {
                Edit::Flip(at, x) if !file.is_empty() => file[at % n] ^= x,
                Edit::Cut(at) => file.truncate(at % n),
                Edit::Insert(at, bytes) => {
                    let at = at % (file.len() + 1);
                    file.splice(at..at, bytes.iter().copied());
                }
                _ => {}
            }
        }
        file
    }

    /// Every tensor of an accepted checkpoint: inside its map, exactly its bytes, readable.
    fn check_accepted(ckpt: &Checkpoint) -> std::result::Result<(), TestCaseError> {
        for (name, entry) in &ckpt.tensors {
            prop_assert_eq!(name, &entry.name);
            let map = ckpt.maps[entry.file].bytes();
            prop_assert!(entry.range.start <= entry.range.end && entry.range.end <= map.len());
            let elements: usize = entry.shape.iter().product();
            prop_assert_eq!(ckpt.bytes(entry).len(), elements * entry.ty.block_bytes() as usize);
            let values = ckpt.to_f32(name, &entry.shape).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(values.len(), elements);
        }
        Ok(())
    }

    /// Cases per property: `PROPTEST_CASES` when set (a longer local run), else what CI runs.
    fn cases(ci: u32) -> u32 {
        std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(ci)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: cases(1024), ..ProptestConfig::default() })]

        #[test]
        fn edited_safetensors_files_are_refused_or_sound(
            tensors in arb_tensors(),
            edits in proptest::collection::vec(arb_edit(), 0..4),
        ) {
            let scratch = Scratch::new("single");
            scratch.write(&[("model.safetensors", &edited_file(&tensors, &edits))]);
            match Checkpoint::open(&scratch.0) {
                Ok(ckpt) => {
                    check_accepted(&ckpt)?;
                    if edits.is_empty() {
                        prop_assert_eq!(ckpt.tensors.len(), tensors.len());
                        for t in &tensors {
                            let entry = ckpt.get(&t.name, &t.shape).map_err(|e| TestCaseError::fail(e.to_string()))?;
                            prop_assert_eq!(entry.ty, t.dtype.ggml());
                        }
                    }
                }
                Err(e) => {
                    prop_assert!(!edits.is_empty(), "a valid file was refused: {}", e);
                    prop_assert!(!e.to_string().is_empty());
                }
            }
        }

        #[test]
        fn arbitrary_bytes_are_refused_or_sound(
            bytes in proptest::collection::vec(any::<u8>(), 0..96),
            prefix in prop_oneof![Just(None), (0..96u64).prop_map(Some)],
        ) {
            let scratch = Scratch::new("bytes");
            let file = match prefix {
                Some(n) => assemble(&bytes, &[], Some(n)),
                None => bytes,
            };
            scratch.write(&[("model.safetensors", &file)]);
            if let Ok(ckpt) = Checkpoint::open(&scratch.0) {
                check_accepted(&ckpt)?;
            }
        }

        /// A shard index may only name files inside the checkpoint directory.
        #[test]
        fn shard_indexes_are_refused_or_sound(
            tensors in arb_tensors(),
            shard in prop_oneof![
                Just("shard.safetensors"),
                Just("../shard.safetensors"),
                Just("/etc/passwd"),
                Just(".shard"),
                Just("a\\b"),
                Just(""),
                Just("missing.safetensors"),
            ],
            index_edit in prop_oneof![Just(None), hostile_value().prop_map(Some)],
        ) {
            let scratch = Scratch::new("index");
            let (header, data) = valid_file(&tensors, 3);
            let file = assemble(&serde_json::to_vec(&header).unwrap_or_default(), &data, None);
            let weight_map: serde_json::Map<String, Value> = tensors
                .iter()
                .map(|t| (t.name.clone(), index_edit.clone().unwrap_or_else(|| json!(shard))))
                .collect();
            let index = serde_json::to_vec(&json!({"metadata": {}, "weight_map": weight_map})).unwrap_or_default();
            scratch.write(&[("model.safetensors.index.json", &index), ("shard.safetensors", &file)]);
            match Checkpoint::open(&scratch.0) {
                Ok(ckpt) => {
                    check_accepted(&ckpt)?;
                    prop_assert!(tensors.is_empty() || (shard == "shard.safetensors" && index_edit.is_none()));
                }
                Err(e) => prop_assert!(
                    !tensors.is_empty() && (shard != "shard.safetensors" || index_edit.is_some()),
                    "a valid sharded checkpoint was refused: {}", e
                ),
            }
        }
    }
}
