//! The one clock: CLOCK_MONOTONIC, which `bpf_ktime_get_ns` reads too, so
//! userspace stamps line up with kernel events without conversion.

/// `clock_gettime(CLOCK_MONOTONIC)` in nanoseconds.
pub fn monotonic_ns() -> u64 {
    read(libc::CLOCK_MONOTONIC)
}

/// `clock_gettime(CLOCK_BOOTTIME)`: MONOTONIC plus the time suspended; the
/// clock of process start times in /proc.
pub fn boottime_ns() -> u64 {
    read(libc::CLOCK_BOOTTIME)
}

/// The calling thread's own CPU time (tests spin for a CPU time, not a
/// wall time, so that a loaded machine does not shorten the spin).
#[cfg(test)]
pub fn thread_cpu_ns() -> u64 {
    read(libc::CLOCK_THREAD_CPUTIME_ID)
}

fn read(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid, writable timespec; these clocks always exist.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    debug_assert_eq!(rc, 0);
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    #[test]
    fn moves_forward() {
        let a = super::monotonic_ns();
        let b = super::monotonic_ns();
        assert!(a > 0 && b >= a);
        assert!(super::boottime_ns() >= a, "boot time includes suspends");
    }
}
