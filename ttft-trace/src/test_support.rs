//! Helpers for the unit tests only.

/// A unit test that cannot run here (root, a kernel file missing) skips
/// with the reason, or fails when `TTFT_TRACE_REQUIRE_FIXTURES` is set (CI
/// sets it), so that a missing piece never passes silently there.
pub fn skip_or_fail(test: &str, why: &str) {
    assert!(
        std::env::var_os("TTFT_TRACE_REQUIRE_FIXTURES").is_none(),
        "{test}: {why}, and TTFT_TRACE_REQUIRE_FIXTURES is set"
    );
    eprintln!("SKIP {test}: {why}");
}
