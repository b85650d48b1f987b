//! Where the segment program runs: on the traced workloads' cgroups
//! (`cgroup_skb` ingress, the default where they have cgroups of their
//! own), or host-wide on `tcp:tcp_probe`.
//!
//! `tcp_probe` runs for every TCP segment of the host, followed or not: on
//! a 1-byte loopback ping-pong that alone was about half of the tracer's
//! +5 % (docs/costs.md). A socket's segments run the programs of
//! the cgroup the socket was created in (and its ancestors'), so the
//! program on the workloads' cgroups leaves every other process's segments
//! to a cgroup check in the kernel, with no program.
//!
//! An accepted connection is its listener's cgroup's: where a listening
//! socket was made in another cgroup (systemd socket activation hands the
//! server a socket of the socket unit's cgroup), that cgroup is added too
//! (`crate::tracking`, asking the kernel through sock_diag).
//!
//! Host-wide instead, for good, where that cannot hold: a traced process
//! or its listener in the root cgroup (or one this host's paths cannot
//! name), ports given with `--port` (whose server may live anywhere), no
//! cgroup v2 hierarchy, or the self-check: followed connections whose
//! bytes were read with none of their segments seen, on a listening port
//! none of whose handshakes was seen either (`Stat::ListenerUnseen`), that
//! no listener's cgroup explains. Data that came with the handshake (a lost
//! final ACK, Fast Open) goes unseen by any hook, but its listener's
//! handshakes are seen: that is not counted.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
};

use aya::programs::{
    CgroupAttachMode, CgroupSkb, CgroupSkbAttachType, cgroup_skb::CgroupSkbLinkId,
};

use super::{ProbeError, Probes, event_hook};

/// The cgroup program, in the eBPF object.
pub(super) const PROGRAM: &str = "skb_segment";

/// Forces segments onto `tcp:tcp_probe` (`tcp_probe`), for comparing the
/// two (`cargo xtask bench`) and testing the host-wide path.
pub const SEGMENT_HOOK_ENV: &str = "TTFT_TRACE_SEGMENT_HOOK";

/// Connections on listeners outside the cgroups before the self-check
/// widens the reach: more than one, so that one odd connection (its
/// listener's handshakes evicted from the kernel's table) does not.
const LISTENER_UNSEEN_MAX: u64 = 1;

/// Where the processes to follow run: each one's cgroup v2 path, or why
/// the segments must be seen host-wide.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SegmentReach {
    Cgroups(BTreeSet<String>),
    /// Host-wide for good.
    Host(String),
    /// Host-wide while the reason lasts (more listening sockets than are
    /// kept): left again at the first reach that is cgroups.
    HostWhile(String),
}

/// How segments are seen now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SegmentHook {
    /// `cgroup_skb` ingress on these cgroups (paths in the v2 hierarchy).
    Cgroups(Vec<String>),
    /// The raw tracepoint, host-wide, and why.
    Raw(String),
    /// The classic tracepoint, and why not the raw one.
    Classic(String),
}

/// The cgroup program's attachments, or the host-wide program.
pub(super) struct Scope {
    /// The cgroup v2 mount: None where the program cannot be used (then
    /// the tracepoint is attached at load).
    mount: Option<PathBuf>,
    links: BTreeMap<String, CgroupSkbLinkId>,
    /// Why segments are seen host-wide, once they are.
    host_wide: Option<String>,
    /// The raw tracepoint's link, once attached here.
    raw_link: Option<aya::programs::raw_trace_point::RawTracePointLinkId>,
    /// Host-wide for a reason that may pass ([`SegmentReach::HostWhile`]).
    host_wide_passes: bool,
}

impl Scope {
    /// Scoped to cgroups (none yet) where the program loaded and the v2
    /// hierarchy is mounted; host-wide (attached by the caller) otherwise.
    pub(super) fn new(mount: Result<PathBuf, String>) -> Self {
        let (mount, host_wide) = match mount {
            Ok(mount) => (Some(mount), None),
            Err(why) => (None, Some(why)),
        };
        Self {
            mount,
            links: BTreeMap::new(),
            host_wide,
            raw_link: None,
            host_wide_passes: false,
        }
    }

    /// Whether segments are seen on cgroups (some, or none yet).
    pub(super) fn scoped(&self) -> bool {
        self.host_wide.is_none()
    }
}

/// Where the cgroup v2 hierarchy is mounted, from a mounts table.
pub fn cgroup2_mount(mounts: &str) -> Option<PathBuf> {
    mounts.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(f[1]))
    })
}

/// The cgroups to attach to: `wanted` without those under another one
/// of it (a socket runs its cgroup's programs and its ancestors', so one
/// attachment on each would see its segments twice).
pub fn outermost(wanted: &BTreeSet<String>) -> BTreeSet<String> {
    wanted
        .iter()
        .filter(|path| {
            !wanted
                .iter()
                .any(|other| other != *path && is_under(path, other))
        })
        .cloned()
        .collect()
}

/// Whether cgroup `path` is `ancestor` or below it.
fn is_under(path: &str, ancestor: &str) -> bool {
    let ancestor = ancestor.trim_end_matches('/');
    path == ancestor
        || path
            .strip_prefix(ancestor)
            .is_some_and(|rest| rest.starts_with('/'))
}

/// A cgroup v2 path as `/proc/PID/cgroup` gives it, if the cgroup
/// program can be put on it: absolute, below the root, every component a
/// plain name (a path outside our cgroup namespace starts with `/..`; a
/// removed cgroup ends in ` (deleted)`).
pub fn attachable(path: &str) -> bool {
    let Some(rest) = path.strip_prefix('/') else {
        return false;
    };
    !rest.is_empty()
        && !path.ends_with(" (deleted)")
        && rest
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
}

/// Opens a cgroup directory below `mount`, following no link.
fn open_cgroup(mount: &Path, path: &str) -> std::io::Result<OwnedFd> {
    let full = mount.join(path.trim_start_matches('/'));
    let c = std::ffi::CString::new(full.into_os_string().into_encoded_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: a NUL-terminated path and plain flags; the result is checked.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: just returned by open, owned by nobody else.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }).into())
}

impl Probes {
    /// How segments are seen now.
    pub fn segment_hook(&self) -> SegmentHook {
        match &self.scope.host_wide {
            None => SegmentHook::Cgroups(self.scope.links.keys().cloned().collect()),
            Some(why) if self.raw_segments => SegmentHook::Raw(why.clone()),
            Some(why) => SegmentHook::Classic(why.clone()),
        }
    }

    /// Cgroups the segment program is attached to now.
    pub fn segment_cgroups(&self) -> usize {
        self.scope.links.len()
    }

    /// Whether segments are seen on cgroups (some, or none yet), not
    /// host-wide.
    pub fn segments_scoped(&self) -> bool {
        self.scope.scoped()
    }

    /// Puts the segment program where `reach` says the followed processes
    /// run: the outermost of their cgroups, or host-wide. Cgroups no
    /// longer wanted are left first, so that no segment is seen twice.
    pub fn scope_segments(&mut self, reach: &SegmentReach) -> Result<(), ProbeError> {
        if self.scope.host_wide.is_some() {
            match (reach, self.scope.host_wide_passes) {
                (SegmentReach::Host(why), true) => {
                    // Host-wide now for good: the link stays.
                    self.scope.host_wide_passes = false;
                    self.scope.host_wide = Some(why.clone());
                    return Ok(());
                }
                (SegmentReach::Cgroups(_), true) => self.leave_host_wide()?,
                _ => return Ok(()),
            }
        }
        let wanted = match reach {
            SegmentReach::Host(why) => return self.segments_host_wide(why.clone()),
            SegmentReach::HostWhile(why) => {
                self.segments_host_wide(why.clone())?;
                self.scope.host_wide_passes = true;
                return Ok(());
            }
            SegmentReach::Cgroups(paths) => outermost(paths),
        };
        if let Some(bad) = wanted.iter().find(|p| !attachable(p)) {
            return self.segments_host_wide(format!("a followed process is in cgroup {bad}"));
        }
        let gone: Vec<String> = self
            .scope
            .links
            .keys()
            .filter(|p| !wanted.contains(*p))
            .cloned()
            .collect();
        for path in gone {
            self.leave_cgroup(&path);
        }
        let Some(mount) = self.scope.mount.clone() else {
            return Ok(());
        };
        for path in wanted {
            if self.scope.links.contains_key(&path) {
                continue;
            }
            let attached = open_cgroup(&mount, &path)
                .map_err(|e| e.to_string())
                .and_then(|fd| {
                    cgroup_program(&mut self.ebpf)
                        .and_then(|p| {
                            // A link (kernels with the ring buffer have
                            // them): always beside the cgroup's other
                            // programs, and the kernel wants no flag for it
                            // (`AllowMultiple` is refused).
                            p.attach(&fd, CgroupSkbAttachType::Ingress, CgroupAttachMode::Single)
                                .map_err(|e| ProbeError::Program(PROGRAM, e))
                        })
                        .map_err(|e| e.to_string())
                });
            match attached {
                Ok(link) => {
                    log::info!("segments: seen at the ingress of cgroup {path}");
                    self.scope.links.insert(path, link);
                }
                // Gone meanwhile (the workload ended): the next scope
                // leaves it out.
                Err(e) => log::warn!("segments: cannot attach to cgroup {path} ({e})"),
            }
        }
        Ok(())
    }

    /// The self-check: host-wide once followed connections had their
    /// bytes read with neither their segments nor their listener's
    /// handshakes seen (`unseen` of them since the last listener's cgroup
    /// was added).
    pub fn check_segment_scope(&mut self, unseen: u64) -> Result<(), ProbeError> {
        if self.scope.host_wide.is_none() && unseen > LISTENER_UNSEEN_MAX {
            log::warn!(
                "segments: {unseen} followed connections were read with none of their segments \
                 seen, on listening sockets outside the traced workloads' cgroups (created by \
                 another process, as with socket activation)"
            );
            return self.segments_host_wide("the self-check".into());
        }
        Ok(())
    }

    /// Leaves the cgroups for the raw tracepoint on every segment of the
    /// host, for good. The cgroups are left first: a segment in between is
    /// missed rather than seen twice.
    fn segments_host_wide(&mut self, why: String) -> Result<(), ProbeError> {
        let paths: Vec<String> = self.scope.links.keys().cloned().collect();
        for path in paths {
            self.leave_cgroup(&path);
        }
        self.scope.raw_link = Some(event_hook::attach_raw_segments(&mut self.ebpf)?);
        self.raw_segments = true;
        self.tracepoints += 1;
        log::info!("segments: raw tracepoint tcp:tcp_probe, host-wide ({why})");
        self.scope.host_wide = Some(why);
        Ok(())
    }

    /// Leaves the raw tracepoint of a [`SegmentReach::HostWhile`] whose
    /// reason passed; the caller then puts the program on the cgroups (a
    /// segment in between is missed rather than seen twice).
    fn leave_host_wide(&mut self) -> Result<(), ProbeError> {
        self.scope.host_wide_passes = false;
        if let Some(link) = self.scope.raw_link.take() {
            event_hook::detach_raw_segments(&mut self.ebpf, link)?;
            self.raw_segments = false;
            self.tracepoints = self.tracepoints.saturating_sub(1);
        }
        if let Some(why) = self.scope.host_wide.take() {
            log::info!("segments: no longer host-wide ({why} no more)");
        }
        Ok(())
    }

    fn leave_cgroup(&mut self, path: &str) {
        let Some(link) = self.scope.links.remove(path) else {
            return;
        };
        // An error means the cgroup is gone, and its attachment with it.
        if let Err(e) = cgroup_program(&mut self.ebpf)
            .and_then(|p| p.detach(link).map_err(|e| ProbeError::Program(PROGRAM, e)))
        {
            log::debug!("segments: leaving cgroup {path}: {e}");
        } else {
            log::info!("segments: cgroup {path} left");
        }
    }
}

impl Probes {
    /// The cgroup v2 path of the cgroup numbered `id` (a socket's, from
    /// sock_diag), as `/proc/PID/cgroup` names one; None where segments
    /// are not seen on cgroups.
    pub fn cgroup_path(&self, id: u64) -> Option<std::io::Result<String>> {
        let mount = self.scope.mount.as_deref()?;
        Some(path_of_cgroup_id(mount, id))
    }
}

/// `FILEID_KERNFS`: the file handle type of a cgroup directory, whose
/// handle is its 64-bit id (uapi `linux/exportfs.h`).
const FILEID_KERNFS: i32 = 0xfe;

/// The path below `mount` of the cgroup numbered `id`: opened by its file
/// handle (no walk of the hierarchy), named by the kernel.
fn path_of_cgroup_id(mount: &Path, id: u64) -> std::io::Result<String> {
    #[repr(C)]
    struct KernfsHandle {
        handle_bytes: u32,
        handle_type: i32,
        id: u64,
    }
    let root = open_cgroup(mount, "/")?;
    let handle = KernfsHandle {
        handle_bytes: 8,
        handle_type: FILEID_KERNFS,
        id,
    };
    // SAFETY: open_by_handle_at(2) reads the handle, which outlives the
    // call; the result is checked.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_by_handle_at,
            root.as_raw_fd(),
            &raw const handle,
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: just returned by the kernel, owned by nobody else.
    let dir = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let full = std::fs::read_link(format!("/proc/self/fd/{}", dir.as_raw_fd()))?;
    let rest = full
        .strip_prefix(mount)
        .map_err(|_| std::io::Error::other(format!("cgroup {id} is at {}", full.display())))?;
    let rest = rest
        .to_str()
        .ok_or_else(|| std::io::Error::other(format!("cgroup {id}: a path not UTF-8")))?;
    Ok(format!("/{rest}"))
}

/// Loads the cgroup program (once).
pub(super) fn load(ebpf: &mut aya::Ebpf) -> Result<(), ProbeError> {
    let prog = cgroup_program(ebpf)?;
    if prog.fd().is_err() {
        prog.load().map_err(|e| ProbeError::Program(PROGRAM, e))?;
    }
    Ok(())
}

fn cgroup_program(ebpf: &mut aya::Ebpf) -> Result<&mut CgroupSkb, ProbeError> {
    ebpf.program_mut(PROGRAM)
        .ok_or(ProbeError::Missing(PROGRAM))?
        .try_into()
        .map_err(|e| ProbeError::Program(PROGRAM, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(paths: &[&str]) -> BTreeSet<String> {
        paths.iter().map(|p| p.to_string()).collect()
    }

    #[test]
    fn names_a_cgroup_by_its_id() {
        let Some(mount) = std::fs::read_to_string("/proc/self/mounts")
            .ok()
            .and_then(|m| cgroup2_mount(&m))
        else {
            crate::test_support::skip_or_fail("names_a_cgroup_by_its_id", "no cgroup v2 hierarchy");
            return;
        };
        // SAFETY: geteuid(2) has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            crate::test_support::skip_or_fail(
                "names_a_cgroup_by_its_id",
                "opening a file handle needs root",
            );
            return;
        }
        let name = format!("ttft-trace-unit-{}", std::process::id());
        let dir = mount.join(&name);
        std::fs::create_dir(&dir).expect("a test cgroup");
        let id =
            std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&dir).expect("the test cgroup"));
        let named = path_of_cgroup_id(&mount, id);
        let root_id =
            std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&mount).expect("the v2 mount"));
        let root = path_of_cgroup_id(&mount, root_id);
        std::fs::remove_dir(&dir).expect("removing the test cgroup");
        assert_eq!(named.expect("named"), format!("/{name}"));
        assert_eq!(root.expect("the root named"), "/");
        // Removed: the kernel no longer finds it.
        assert!(path_of_cgroup_id(&mount, id).is_err());
    }

    #[test]
    fn keeps_the_outermost_cgroups() {
        let wanted = set(&[
            "/kubepods/pod1/c1",
            "/kubepods/pod1",
            "/kubepods/pod10/c2",
            "/system.slice/a.service",
        ]);
        assert_eq!(
            outermost(&wanted),
            set(&[
                "/kubepods/pod1",
                "/kubepods/pod10/c2",
                "/system.slice/a.service"
            ])
        );
        assert_eq!(outermost(&set(&["/a/b"])), set(&["/a/b"]));
    }

    #[test]
    fn names_only_plain_cgroups_below_the_root() {
        assert!(attachable("/system.slice/vllm.service"));
        assert!(attachable("/kubepods/pod1/0123abcd"));
        for bad in [
            "/",
            "",
            "system.slice",
            "/../../outside",
            "/a/./b",
            "/a//b",
            "/a/b (deleted)",
        ] {
            assert!(!attachable(bad), "{bad}");
        }
    }

    #[test]
    fn finds_the_v2_mount_on_pure_and_hybrid_hosts() {
        let pure = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n";
        let hybrid = "tmpfs /sys/fs/cgroup tmpfs ro 0 0\n\
                      cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n\
                      cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n";
        assert_eq!(cgroup2_mount(pure), Some(PathBuf::from("/sys/fs/cgroup")));
        assert_eq!(
            cgroup2_mount(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(cgroup2_mount("proc /proc proc rw 0 0\n"), None);
    }
}
