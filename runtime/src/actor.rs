//! The actor contract, defined in `tessera-actor-core` (no actix, ZeroMQ or tokio) and
//! re-exported here so the real-time host and its users name one set of types.
pub use tessera_actor_core::actor::*;
