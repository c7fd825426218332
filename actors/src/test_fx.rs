//! The recording `Effects` of the actor core's testkit, for this crate's message type.

pub type TestFx = tessera_actor_core::testkit::TestFx<crate::msg::Msg>;
