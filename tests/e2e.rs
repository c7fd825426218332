//! The workspace's end-to-end and cross-crate tests, in one binary (each integration-test
//! binary links the whole workspace): the model against a reference forward, the kernel
//! ABI, the CLI and its refusals of bad input, serving across host processes with their
//! faults, hosts in separate network namespaces reached by name, a cluster shared by
//! tenants (keys, quotas, roles, audit), prefill/decode disaggregation, a real model
//! from a GGUF file, and the documentation (the README's commands run as written, every link resolves).

mod common;
#[path = "common/serve.rs"]
mod serve_kit;

mod bad_input;
mod cli;
mod disagg;
mod gguf;
mod kernels_abi;
mod links;
mod model;
mod netns;
mod parallel;
mod quantize;
mod readme;
mod secure;
mod serve;
mod structured;
mod tenancy;
