//! The crate's error type and its mapping to ABI status codes.

use tessera_kernel_abi::{
    TK_ERR_INTERNAL, TK_ERR_INVALID_ARGUMENT, TK_ERR_OUT_OF_MEMORY, TK_ERR_UNSUPPORTED, TkStatus,
};

/// An error an op or the FFI layer reports; the string is the human-readable message.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    OutOfMemory(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Internal(String),
}

impl KernelError {
    /// The ABI status code for this error.
    pub fn status(&self) -> TkStatus {
        match self {
            KernelError::InvalidArgument(_) => TK_ERR_INVALID_ARGUMENT,
            KernelError::OutOfMemory(_) => TK_ERR_OUT_OF_MEMORY,
            KernelError::Unsupported(_) => TK_ERR_UNSUPPORTED,
            KernelError::Internal(_) => TK_ERR_INTERNAL,
        }
    }
}

/// Shorthand for an invalid-argument error built with `format!`.
#[macro_export]
macro_rules! invalid {
    ($($t:tt)*) => { $crate::error::KernelError::InvalidArgument(format!($($t)*)) };
}

pub type Result<T> = std::result::Result<T, KernelError>;
