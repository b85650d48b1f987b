//! ttft-trace: per-request time-to-first-token tracing for GPU inference servers.
