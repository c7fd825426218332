//! placeholder (loadgen helper)
