//! Checkpoint tensors from safetensors files (single or sharded with an index),
//! memory-mapped and validated: every tensor's dtype, shape and byte range are checked
//! before anything is handed to a device.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::device::{Buffer, Device};
use crate::dtype::DType;
use crate::error::{BackendError, Result};
use crate::mmap::map_file;

/// Where one tensor lives.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    file: usize,
    range: Range<usize>,
}

/// All tensors of a checkpoint directory, memory-mapped.
pub struct Checkpoint {
    dir: PathBuf,
    maps: Vec<Arc<Mmap>>,
    tensors: HashMap<String, TensorEntry>,
}

#[derive(serde::Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors`, or the shards listed in
    /// `dir/model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
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
                    dtype,
                    shape: view.shape().to_vec(),
                    file: file_idx,
                    range: start..start + view.data().len(),
                };
                if tensors.insert(name.clone(), entry).is_some() {
                    return Err(st_err(format!("tensor {name:?} appears in more than one shard")));
                }
            }
            maps.push(map);
        }
        Ok(Checkpoint { dir: dir.to_path_buf(), maps, tensors })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
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
        &self.maps[entry.file][entry.range.clone()]
    }

    /// The tensor converted to f32 on the host (for tests and reference paths).
    pub fn to_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let entry = self.get(name, shape)?;
        Ok(convert_to_f32(self.bytes(entry), entry.dtype))
    }

    /// Puts a tensor on `device` as `dtype`. When the file already holds `dtype` and the
    /// device shares host memory, the map itself becomes the buffer (no copy).
    pub fn upload(&self, device: &Device, name: &str, shape: &[usize], dtype: DType) -> Result<Buffer> {
        let entry = self.get(name, shape)?;
        let bytes = self.bytes(entry);
        if entry.dtype == dtype {
            let aligned = entry.range.start % dtype.size_bytes() == 0;
            if device.info().host_memory_shared && aligned {
                return device.wrap_host(self.maps[entry.file].clone(), entry.range.clone());
            }
            return device.upload(bytes);
        }
        let converted = convert(bytes, entry.dtype, dtype);
        device.upload(&converted)
    }
}

/// Little-endian elements of `from` to f32.
pub fn convert_to_f32(bytes: &[u8], from: DType) -> Vec<f32> {
    match from {
        DType::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        DType::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
    }
}

/// f32 values as little-endian bytes of `to` (round to nearest even).
pub fn f32_to_bytes(values: &[f32], to: DType) -> Vec<u8> {
    match to {
        DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => values.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect(),
        DType::BF16 => values.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect(),
    }
}

fn convert(bytes: &[u8], from: DType, to: DType) -> Vec<u8> {
    f32_to_bytes(&convert_to_f32(bytes, from), to)
}
