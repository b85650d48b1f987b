//! ttft-trace: per-request time-to-first-token tracing for GPU inference servers.
//!
//! One path through the house, each stage owning its state:
//! `tracking` (which processes, libraries and ports; the probes and kernel
//! maps), `routing` (ring-buffer events to each workload's correlator and
//! signals), `judging` (evidence and causes), `export` (Prometheus, JSONL,
//! terminal), and `session`, which holds them and runs the event loop.
//! `config` merges the flags and the settings file. The domain modules
//! below them are pure: `requests` (HTTP requests and their figures),
//! `causes` (attribution rules), `signals`, `episodes`, `nvml`, `workloads`.
//! `jsonl_schema` defines the JSONL file's lines, for its writer (`export`)
//! and its reader (`report`).

pub mod causes;
pub mod check;
pub mod config;
pub mod decode;
pub mod episodes;
pub mod export;
pub mod host;
pub mod jsonl_schema;
pub mod judging;
pub mod nvml;
pub mod probes;
pub mod record;
pub mod report;
pub mod requests;
pub mod routing;
pub mod schedstat;
pub mod session;
pub mod signals;
#[cfg(test)]
mod test_support;
pub mod tracking;
pub mod workloads;
