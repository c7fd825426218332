//! Tessera's data plane on one chip: the kernel ABI loader and safe `Device` wrapper,
//! model configs and memory-mapped weights, the Llama-family executor over a paged KV
//! cache, tokenizer and sampling. It knows nothing of actors, buses or topology files,
//! and reaches kernels only through the C ABI of a library loaded at run time.

pub mod bench;
pub mod builtin;
pub mod compat;
pub mod config;
pub mod constraint;
pub mod cost;
pub mod device;
pub mod dtype;
pub mod error;
pub mod gguf;
pub mod instance;
pub mod kv;
pub mod kv_format;
#[allow(unsafe_code)]
pub mod loader;
#[allow(unsafe_code)]
pub mod mmap;
pub mod model;
pub mod npy;
pub mod profile;
pub mod sampling;
pub mod shard;
pub mod stage_link;
pub mod synth;
pub mod tokenizer;
pub mod weights;
