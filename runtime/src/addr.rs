//! Actor addresses, defined in `tessera-actor-core`.
pub use tessera_actor_core::addr::*;
