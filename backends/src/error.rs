//! The one error type of the backends crate. Each variant names what was wrong and
//! where (file, tensor, library, symbol) so an operator can act on it.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    // Not a `#[source]`: the message already carries it, and `{:#}` would print it twice.
    #[error("cannot read {path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: invalid model config: {reason}")]
    Config { path: PathBuf, reason: String },
    #[error("{path}: unsupported architecture {arch:?} (supported: {supported})")]
    UnknownArchitecture { path: PathBuf, arch: String, supported: String },
    #[error("{path}: invalid safetensors file: {reason}")]
    Safetensors { path: PathBuf, reason: String },
    #[error("checkpoint {dir}: missing tensor {name:?}")]
    MissingTensor { dir: PathBuf, name: String },
    #[error("checkpoint {dir}: tensor {name:?} has shape {found:?}, expected {expected:?}")]
    TensorShape { dir: PathBuf, name: String, found: Vec<usize>, expected: Vec<usize> },
    #[error("checkpoint {dir}: tensor {name:?} has dtype {found}, supported: F32, F16, BF16")]
    TensorDtype { dir: PathBuf, name: String, found: String },
    #[error("{path}: invalid GGUF file: {reason}")]
    Gguf { path: PathBuf, reason: crate::gguf::GgufError },
    #[error("cannot quantize tensor {name:?}: {reason}")]
    Quantize { name: String, reason: String },
    #[error("TESSERA_MAP_WEIGHTS={value:?} is none of auto, yes, no")]
    WeightPlacement { value: String },
    #[error("{path}: tokenizer: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
    #[error("kernel library {library}: {reason}")]
    KernelLibrary { library: PathBuf, reason: String },
    #[error("kernel library {library}: missing symbol `{symbol}` (required by ABI {abi_major}.{abi_minor})")]
    MissingSymbol { library: PathBuf, symbol: String, abi_major: u32, abi_minor: u32 },
    #[error(
        "kernel library {library}: ABI version {found_major}.{found_minor} is not compatible with \
         this Tessera (needs {need_major}.x with x >= {need_minor})"
    )]
    AbiVersion { library: PathBuf, found_major: u32, found_minor: u32, need_major: u32, need_minor: u32 },
    #[error("kernel {op} failed on {device} ({status}): {message}")]
    Kernel { op: &'static str, device: String, status: &'static str, message: String },
    /// The link to a pipeline stage on another host (`addr`: the other end).
    #[error("stage link {addr}: {reason}")]
    StageLink { addr: String, reason: String },
    #[error("KV cache: {0}")]
    KvCache(String),
    #[error("invalid request: {0}")]
    Request(String),
    /// A shard of a model (a pipeline stage, a tensor-parallel rank) that cannot be made
    /// or run as asked.
    #[error("model shard: {0}")]
    Shard(String),
}

pub type Result<T> = std::result::Result<T, BackendError>;

impl BackendError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        BackendError::Io { path: path.into(), error: source }
    }
}
