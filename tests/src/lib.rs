pub mod container;
pub mod demo;
pub mod faults;
pub mod fixtures;
pub mod otlp_receiver;
pub mod prometheus;
pub mod server_clock;
pub mod stacks;
pub mod stalls;
pub mod stub_gpu;
pub mod tenant;
pub mod tracer;

/// A test that cannot run here (a fixture, a tool or root missing) skips
/// with the reason, or fails when `TTFT_TRACE_REQUIRE_FIXTURES` is set (CI
/// sets it), so that a missing piece never passes silently there.
pub fn skip_or_fail(test: &str, why: &str) {
    assert!(
        std::env::var_os("TTFT_TRACE_REQUIRE_FIXTURES").is_none(),
        "{test}: {why}, and TTFT_TRACE_REQUIRE_FIXTURES is set"
    );
    eprintln!("SKIP {test}: {why}");
}
