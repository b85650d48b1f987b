//! ttft-trace: per-request time-to-first-token tracing for GPU inference servers.
//!
//! A pipeline of small modules: `probes` (load, attach, maps), `decode`
//! (ring-buffer bytes to events), `episodes` (what is reported per GPU
//! episode), `record` (exact percentiles), `metrics` (Prometheus), `targets`
//! (the traced process tree), `session` (the event loop tying them).

pub mod caps;
pub mod causes;
pub mod check;
pub mod clock;
pub mod decode;
pub mod episodes;
pub mod metrics;
pub mod nvml;
pub mod ports;
pub mod probes;
pub mod record;
pub mod requests;
pub mod rootfs;
pub mod session;
pub mod signals;
pub mod targets;
pub mod tracefs;
pub mod workloads;
