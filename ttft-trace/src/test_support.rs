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

/// Whether the unit test may go on: root opens other processes' (and its
/// own) `/proc/PID/map_files`; otherwise it skips or fails as
/// [`skip_or_fail`] says.
pub fn root_or_skip(test: &str) -> bool {
    // SAFETY: geteuid(2) has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        skip_or_fail(test, "needs root (opens /proc/PID/map_files)");
    }
    root
}
