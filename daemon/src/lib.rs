//! kvaffined: follows every vLLM replica's KV events and answers which replicas hold the
//! longest prefix of a request's block keys, and how loaded they are.
//!
//! The binary (`src/main.rs`) is a thin command line over these modules; they are a
//! library so benchmarks and tests can drive the index and API in-process.

pub mod auth;
pub mod backlog;
pub mod bookings;
pub mod check_cmd;
pub mod config;
pub mod console;
pub mod demand;
pub mod discovery;
pub mod history;
pub mod http;
pub mod huge;
pub mod hybrid;
pub mod index;
pub mod ingest;
pub mod keys_cmd;
pub mod metrics;
pub mod outcomes;
pub mod peers;
pub mod route;
pub mod salts;
pub mod scrape;
pub mod serve;
pub mod slots;
pub mod speed;
pub mod state;
