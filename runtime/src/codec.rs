//! placeholder (bus helper)
