//! Holds the core benchmarks (`benches/core.rs`); run them with `cargo xtask bench core`.
