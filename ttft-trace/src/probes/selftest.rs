//! A uprobe that is known to fire: the driver launch program attached to a
//! function of this very binary, called once by this thread (`ttft-trace check`).

use std::{num::NonZeroU32, path::PathBuf};

use aya::programs::uprobe::UProbeScope;

use super::{
    ProbeError, Probes, Reach,
    libraries::{uprobe, uprobe_error},
};

/// The program attached: it counts a kernel launch for a tracked process.
const PROGRAM: &str = "cu_launch_kernel";

/// The probed function: opaque to the optimiser, so it is really called.
#[inline(never)]
extern "C" fn selftest_target(x: u64) -> u64 {
    std::hint::black_box(x).wrapping_add(1)
}

/// The file and file offset of `addr` from the text of `/proc/self/maps`.
pub(crate) fn file_offset_in_maps(maps: &str, addr: u64) -> Option<(PathBuf, u64)> {
    maps.lines().find_map(|line| {
        // start-end perms offset dev inode path
        let mut parts = line.split_whitespace();
        let (range, _perms, offset) = (parts.next()?, parts.next()?, parts.next()?);
        let path = parts.nth(2)?;
        let (start, end) = range.split_once('-')?;
        let start = u64::from_str_radix(start, 16).ok()?;
        let end = u64::from_str_radix(end, 16).ok()?;
        let offset = u64::from_str_radix(offset, 16).ok()?;
        (path.starts_with('/') && (start..end).contains(&addr))
            .then(|| (PathBuf::from(path), addr - start + offset))
    })
}

impl Probes {
    /// Attaches a uprobe to a function of this binary (this process only),
    /// calls it once and returns how many launches the probe counted: 1 when
    /// uprobes work. The probe is detached and the process untracked after.
    pub fn uprobe_selftest(&mut self) -> Result<u64, ProbeError> {
        let target: extern "C" fn(u64) -> u64 = selftest_target;
        let addr = target as usize as u64;
        let maps = std::fs::read_to_string("/proc/self/maps")
            .map_err(|e| ProbeError::Stat("/proc/self/maps".into(), e))?;
        let (path, offset) =
            file_offset_in_maps(&maps, addr).ok_or(ProbeError::Missing("self-test function"))?;
        let pid = std::process::id();
        let scope =
            NonZeroU32::new(pid).map_or(UProbeScope::CallingProcess, UProbeScope::OneProcess);
        let reach = NonZeroU32::new(pid).map_or(Reach::Host, Reach::Process);
        let prog = uprobe(&mut self.ebpf, PROGRAM)?;
        let link = prog
            .attach(offset, &path, scope)
            .map_err(|e| uprobe_error(PROGRAM, &path, reach, e))?;
        self.track(pid, pid)?;
        std::hint::black_box(std::hint::black_box(target)(1));
        let launches = self.counters()?.get(&pid).map_or(0, |c| c.kernel_launches);
        self.untrack(pid)?;
        self.drop_counters(pid)?;
        let prog = uprobe(&mut self.ebpf, PROGRAM)?;
        prog.detach(link)
            .map_err(|e| ProbeError::Program(PROGRAM, e))?;
        Ok(launches)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_file_offset_of_an_address() {
        let maps = "\
55d0c0a00000-55d0c0a01000 r--p 00000000 fd:01 1234 /usr/local/bin/ttft-trace
55d0c0a01000-55d0c0a09000 r-xp 00001000 fd:01 1234 /usr/local/bin/ttft-trace
7ffd00000000-7ffd00001000 r-xp 00000000 00:00 0                          [vdso]
";
        assert_eq!(
            file_offset_in_maps(maps, 0x55d0_c0a0_1230),
            Some((PathBuf::from("/usr/local/bin/ttft-trace"), 0x1230))
        );
        assert_eq!(file_offset_in_maps(maps, 0x7ffd_0000_0010), None);
        assert_eq!(file_offset_in_maps(maps, 0x1000), None);
    }

    #[test]
    fn finds_this_test_binary() {
        let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
        let target: extern "C" fn(u64) -> u64 = selftest_target;
        let (path, _) = file_offset_in_maps(&maps, target as usize as u64).expect("mapped");
        assert_eq!(
            path.canonicalize().ok(),
            std::env::current_exe().and_then(|p| p.canonicalize()).ok()
        );
    }
}
