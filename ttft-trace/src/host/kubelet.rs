//! Pod names as the host records them: the kubelet's pod log directory
//! (`/var/log/pods` by default), whose entries it names
//! `<namespace>_<pod name>_<pod UID>`. A process's pod UID comes from its
//! cgroup path ([`super::cgroups::pod_uid`]), which only the kubelet and
//! the runtime write; its namespace and pod name come from here. Nothing a
//! pod's processes write (their environment, files in their root) is read:
//! a tenant cannot choose the names its series carry.
//!
//! The directory is the host's, but its names are still treated as
//! hostile: one that is not exactly three well-formed fields is skipped, a
//! UID listed under two different names names nothing, and the reading is
//! bounded (entries read per scan, UIDs kept, scans per second).

use std::{
    collections::HashMap,
    io,
    os::fd::{AsRawFd, OwnedFd},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use thiserror::Error;

use super::rootfs::openat2_mode;

/// Where the kubelet keeps its pod logs (the default of its `podLogsDir`).
pub const DEFAULT_POD_LOG_DIR: &str = "/var/log/pods";
/// Most directory entries read in one scan: a node runs at most a few
/// hundred pods (the kubelet's default `maxPods` is 110); past this the
/// scan stops (counted as `pod_log_dir_entries`).
pub const MAX_ENTRIES: usize = 8192;
/// Most pod UIDs kept from one scan (the rest counted as `pod_records`).
pub const MAX_RECORDS: usize = 1024;
/// A UID not known rescans the directory at most this often: a process in
/// a pod whose directory is gone (or never was) cannot make the daemon list
/// it on every lookup.
pub const RESCAN_MIN: Duration = Duration::from_secs(1);
/// Bytes asked of each `getdents64` call.
const DENTS_BUF: usize = 32 << 10;

/// Kubernetes limits: a namespace is a DNS-1123 label, a pod name a
/// DNS-1123 subdomain.
const NAMESPACE_MAX: usize = 63;
const POD_NAME_MAX: usize = 253;

#[derive(Debug, Error)]
pub enum KubeletError {
    #[error(
        "cannot open the pod log directory {dir} (symlinks are not followed; pods are named by \
         their UID): {source}"
    )]
    Open { dir: PathBuf, source: io::Error },
    #[error("reading the pod log directory {dir}: {source}")]
    Read { dir: PathBuf, source: io::Error },
}

/// A pod's namespace and name, as the host records them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodName {
    pub namespace: String,
    pub name: String,
}

/// What the directory says of one UID.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Record {
    Named(PodName),
    /// Listed under two different names: neither is believed.
    Ambiguous,
}

/// The UIDs the pod log directory lists, refreshed when a UID is missing
/// (at most once per [`RESCAN_MIN`]).
#[derive(Debug)]
pub struct PodRecords {
    dir: PathBuf,
    records: HashMap<String, Record>,
    last_scan: Option<Instant>,
    /// Scans that stopped at [`MAX_ENTRIES`] with entries left unread.
    pub entries_dropped: u64,
    /// UIDs not kept because [`MAX_RECORDS`] were.
    pub records_dropped: u64,
    /// The last scan failed (logged once until one succeeds).
    failing: bool,
}

impl PodRecords {
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            records: HashMap::new(),
            last_scan: None,
            entries_dropped: 0,
            records_dropped: 0,
            failing: false,
        }
    }

    /// The namespace and name the host records for pod `uid` (as
    /// [`super::cgroups::pod_uid`] gives it), rescanning the directory when
    /// the UID is not known and the last scan is old enough. None when the
    /// directory does not list it, or lists it under two names.
    pub fn lookup(&mut self, uid: &str, now: Instant) -> Option<PodName> {
        let due = self
            .last_scan
            .is_none_or(|t| now.saturating_duration_since(t) >= RESCAN_MIN);
        if !self.records.contains_key(uid) && due {
            self.last_scan = Some(now);
            match self.scan(uid) {
                Ok(()) => self.failing = false,
                Err(e) => {
                    if !self.failing {
                        log::warn!("{e}");
                    }
                    self.failing = true;
                }
            }
        }
        match self.records.get(uid)? {
            Record::Named(n) => Some(n.clone()),
            Record::Ambiguous => None,
        }
    }

    /// Reads the directory anew (the records of pods gone go with it);
    /// `wanted` is kept even when the table is full.
    fn scan(&mut self, wanted: &str) -> Result<(), KubeletError> {
        let (names, truncated) = read_names(&self.dir, MAX_ENTRIES)?;
        if truncated {
            self.entries_dropped += 1;
        }
        let (records, dropped) = build(names.iter().map(Vec::as_slice), wanted, MAX_RECORDS);
        self.records_dropped += dropped;
        self.records = records;
        Ok(())
    }
}

/// The records of the entries `names`: at most `max` UIDs, `wanted` among
/// them whenever listed; returns them and how many UIDs were not kept.
fn build<'a>(
    names: impl Iterator<Item = &'a [u8]>,
    wanted: &str,
    max: usize,
) -> (HashMap<String, Record>, u64) {
    let mut records: HashMap<String, Record> = HashMap::new();
    let mut dropped = 0;
    let mut wanted_kept = false;
    for (uid, pod) in names.filter_map(parse_entry) {
        if let Some(r) = records.get_mut(&uid) {
            if *r != Record::Named(pod) {
                *r = Record::Ambiguous;
            }
            continue;
        }
        // Room is held for `wanted` until it is seen.
        let room = max.saturating_sub(usize::from(!wanted_kept));
        if uid == wanted {
            wanted_kept = true;
        } else if records.len() >= room {
            dropped += 1;
            continue;
        }
        records.insert(uid, Record::Named(pod));
    }
    (records, dropped)
}

/// `<namespace>_<pod name>_<uid>` (the kubelet's `BuildPodLogsDirectory`):
/// a DNS-1123 label, a DNS-1123 subdomain and a lower-case RFC 4122 UID,
/// none of which holds `_`; anything else is None.
pub fn parse_entry(name: &[u8]) -> Option<(String, PodName)> {
    let mut fields = name.split(|&b| b == b'_');
    let (namespace, pod, uid) = (fields.next()?, fields.next()?, fields.next()?);
    if fields.next().is_some() || !is_dns_label(namespace) || !is_dns_subdomain(pod) || !is_uid(uid)
    {
        return None;
    }
    // Only ASCII passed the checks.
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    Some((
        text(uid),
        PodName {
            namespace: text(namespace),
            name: text(pod),
        },
    ))
}

/// A lower-case RFC 4122 UUID (8-4-4-4-12 hex digits), as the API server
/// gives every pod.
pub fn is_uid(b: &[u8]) -> bool {
    b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_digit() || (b'a'..=b'f').contains(c),
        })
}

/// A DNS-1123 label: 1-63 lower-case letters, digits and `-`, starting and
/// ending with a letter or digit.
fn is_dns_label(b: &[u8]) -> bool {
    let alnum = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !b.is_empty()
        && b.len() <= NAMESPACE_MAX
        && b.iter().all(|c| alnum(c) || *c == b'-')
        && b.first().is_some_and(alnum)
        && b.last().is_some_and(alnum)
}

/// A DNS-1123 subdomain: at most 253 characters, DNS-1123 labels joined by
/// dots.
fn is_dns_subdomain(b: &[u8]) -> bool {
    b.len() <= POD_NAME_MAX && b.split(|&c| c == b'.').all(is_dns_label)
}

/// The names in directory `dir`, at most `max` of them (`.` and `..`
/// excepted), and whether entries were left unread. The directory is
/// opened without following a symlink in any component; entries that are
/// symlinks or no directories are skipped by their type, without a `stat`
/// of their own.
fn read_names(dir: &Path, max: usize) -> Result<(Vec<Vec<u8>>, bool), KubeletError> {
    let fd = open_dir(dir).map_err(|source| KubeletError::Open {
        dir: dir.to_path_buf(),
        source,
    })?;
    let mut names = Vec::new();
    let mut read = 0;
    let mut buf = vec![0u8; DENTS_BUF];
    loop {
        let n = getdents(&fd, &mut buf).map_err(|source| KubeletError::Read {
            dir: dir.to_path_buf(),
            source,
        })?;
        if n == 0 {
            return Ok((names, false));
        }
        for (d_type, name) in dirents(&buf[..n]) {
            if name == b"." || name == b".." {
                continue;
            }
            if read == max {
                return Ok((names, true));
            }
            read += 1;
            // DT_UNKNOWN: a filesystem that does not say; the name is all
            // that is used, and it is checked.
            if d_type == libc::DT_DIR || d_type == libc::DT_UNKNOWN {
                names.push(name.to_vec());
            }
        }
    }
}

/// `dir` opened for reading its entries: no symlink followed anywhere on
/// the path, non-blocking (a FIFO or device put in its place fails the
/// `O_DIRECTORY` check instead of blocking the open).
fn open_dir(dir: &Path) -> io::Result<OwnedFd> {
    openat2_mode(
        libc::AT_FDCWD,
        dir,
        libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NONBLOCK | libc::O_CLOEXEC,
        0,
        libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS,
    )
}

/// One `getdents64(2)` into `buf`: bytes filled, 0 at the end.
fn getdents(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: the kernel writes at most buf.len() bytes into buf, which
    // outlives the call; the descriptor is open.
    let n = unsafe {
        libc::syscall(
            libc::SYS_getdents64,
            fd.as_raw_fd(),
            buf.as_mut_ptr(),
            buf.len(),
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    usize::try_from(n).map_err(|_| io::Error::other("getdents64 returned a negative count"))
}

/// (d_type, d_name) of each `linux_dirent64` record in `buf`: u64 inode,
/// i64 offset, u16 record length, u8 type, then the NUL-terminated name.
fn dirents(buf: &[u8]) -> impl Iterator<Item = (u8, &[u8])> {
    const NAME_AT: usize = 19;
    let mut at = 0;
    std::iter::from_fn(move || {
        let rec = buf.get(at..)?;
        let reclen = usize::from(u16::from_ne_bytes([*rec.get(16)?, *rec.get(17)?]));
        let body = rec.get(NAME_AT..reclen)?;
        at += reclen;
        let name = body.split(|&b| b == 0).next().unwrap_or_default();
        Some((rec[18], name))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901";
    const UID2: &str = "0a1b2c3d-4e5f-4061-8273-94a5b6c7d8e9";

    fn named(ns: &str, pod: &str) -> PodName {
        PodName {
            namespace: ns.into(),
            name: pod.into(),
        }
    }

    #[test]
    fn parses_only_the_kubelets_names() {
        assert_eq!(
            parse_entry(format!("serving_vllm-0.a_{UID}").as_bytes()),
            Some((UID.to_string(), named("serving", "vllm-0.a")))
        );
        let long_ns = "n".repeat(64);
        let long_pod = format!("{}.{}", "p".repeat(63), "q".repeat(190));
        for bad in [
            String::new(),
            format!("serving_vllm_{UID}_extra"),
            format!("serving_{UID}"),
            format!("Serving_vllm_{UID}"),
            format!("serving_vllm-_{UID}"),
            format!("serving_.vllm_{UID}"),
            format!("serving_vllm..0_{UID}"),
            format!("serv.ing_vllm_{UID}"),
            format!("{long_ns}_vllm_{UID}"),
            format!("serving_{long_pod}_{UID}"),
            format!("serving_vllm_{}", UID.to_uppercase()),
            format!("serving_vllm_{}", UID.replace('-', "_")),
            format!("serving_vllm_{}", &UID[..35]),
            format!("serving_vllm_{UID}0"),
            "serving_vllm_0123456789abcdef0123456789abcdef".into(),
            format!("serving_vllm\n_{UID}"),
            format!("serving_vll\u{e9}_{UID}"),
            format!("_vllm_{UID}"),
        ] {
            assert_eq!(parse_entry(bad.as_bytes()), None, "{bad:?}");
        }
        // The longest names Kubernetes allows are accepted.
        let ns63 = "n".repeat(63);
        let pod253 = format!(
            "{}.{}.{}.{}",
            "p".repeat(63),
            "q".repeat(63),
            "r".repeat(63),
            "s".repeat(61)
        );
        assert_eq!(pod253.len(), 253);
        assert!(parse_entry(format!("{ns63}_{pod253}_{UID}").as_bytes()).is_some());
    }

    #[test]
    fn a_uid_under_two_names_names_nothing() {
        let a = format!("serving_vllm-0_{UID}");
        let b = format!("other_vllm-0_{UID}");
        let c = format!("serving_vllm-1_{UID2}");
        let (r, dropped) = build(
            [a.as_bytes(), b.as_bytes(), c.as_bytes()].into_iter(),
            UID,
            16,
        );
        assert_eq!(dropped, 0);
        assert_eq!(r.get(UID), Some(&Record::Ambiguous));
        assert_eq!(
            r.get(UID2),
            Some(&Record::Named(named("serving", "vllm-1")))
        );
        // A third listing does not make it believed again.
        let (r, _) = build(
            [a.as_bytes(), b.as_bytes(), a.as_bytes()].into_iter(),
            UID,
            16,
        );
        assert_eq!(r.get(UID), Some(&Record::Ambiguous));
    }

    #[test]
    fn keeps_at_most_max_uids_and_always_the_wanted_one() {
        let names: Vec<String> = (0..10u32)
            .map(|i| format!("ns_pod-{i}_{i:08x}-0000-4000-8000-000000000000"))
            .collect();
        let wanted = "00000009-0000-4000-8000-000000000000";
        let (r, dropped) = build(names.iter().map(|s| s.as_bytes()), wanted, 4);
        assert_eq!(r.len(), 4);
        assert_eq!(dropped, 6);
        assert_eq!(
            r.get(wanted),
            Some(&Record::Named(named("ns", "pod-9"))),
            "the UID looked up is kept though it comes last"
        );
        // Without the wanted one listed, the cap holds all the same.
        let (r, dropped) = build(names.iter().map(|s| s.as_bytes()), UID, 4);
        assert_eq!((r.len(), dropped), (3, 7));
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ttft-pods-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        dir
    }

    #[test]
    fn reads_a_directory_bounded_and_rescans_at_most_once_a_second() {
        let dir = temp_dir("scan");
        std::fs::create_dir(dir.join(format!("serving_vllm-0_{UID}"))).expect("pod dir");
        // A file and a symlink named like pods are not the kubelet's.
        std::fs::write(dir.join(format!("evil_file_{UID2}")), "").expect("file");
        std::os::unix::fs::symlink("/", dir.join(format!("evil_link_{UID2}"))).expect("link");
        let mut pods = PodRecords::new(&dir);
        let t0 = Instant::now();
        assert_eq!(pods.lookup(UID, t0), Some(named("serving", "vllm-0")));
        assert_eq!(pods.lookup(UID2, t0 + Duration::from_secs(2)), None);
        // A pod that appears is found by the next scan, not before a second.
        std::fs::create_dir(dir.join(format!("serving_late_{UID2}"))).expect("late");
        let t1 = t0 + Duration::from_secs(2);
        assert_eq!(pods.lookup(UID2, t1 + Duration::from_millis(500)), None);
        assert_eq!(
            pods.lookup(UID2, t1 + RESCAN_MIN),
            Some(named("serving", "late"))
        );
        // Entries past the cap are not read, and the scan says so.
        for i in 0..5u32 {
            std::fs::create_dir(dir.join(format!("x{i}"))).expect("filler");
        }
        let (names, truncated) = read_names(&dir, 3).expect("read");
        assert_eq!((names.len() <= 3, truncated), (true, true));
        let (names, truncated) = read_names(&dir, MAX_ENTRIES).expect("read");
        assert_eq!((names.len(), truncated), (7, false));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn never_follows_a_symlink_to_the_directory() {
        let dir = temp_dir("real");
        std::fs::create_dir(dir.join(format!("serving_vllm-0_{UID}"))).expect("pod dir");
        let link = std::env::temp_dir().join(format!("ttft-pods-link-{}", std::process::id()));
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&dir, &link).expect("link");
        let err = read_names(&link, MAX_ENTRIES).expect_err("a symlink is refused");
        assert!(matches!(err, KubeletError::Open { .. }), "{err}");
        let mut pods = PodRecords::new(&link);
        assert_eq!(pods.lookup(UID, Instant::now()), None);
        let _ = std::fs::remove_file(&link);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// What one scan costs, by entries in the directory (the figures in
    /// docs/measurements.md): `cargo test -p ttft-trace --lib scan_cost --
    /// --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement, not a check"]
    fn scan_cost() {
        for n in [110u32, 1024, 8192, 20_000] {
            let dir = temp_dir(&format!("cost-{n}"));
            for i in 0..n {
                let entry = format!("ns-{}_pod-{i}_{i:08x}-0000-4000-8000-000000000000", i % 50);
                std::fs::create_dir(dir.join(entry)).expect("entry");
            }
            let mut pods = PodRecords::new(&dir);
            let t0 = Instant::now();
            let mut times = Vec::new();
            for k in 0..21u64 {
                // A UID never listed: every lookup is a full scan.
                let now = t0 + RESCAN_MIN * u32::try_from(k + 1).expect("small");
                let start = Instant::now();
                assert_eq!(pods.lookup(UID, now), None);
                times.push(start.elapsed());
            }
            times.sort();
            eprintln!(
                "{n} entries: median scan {:?} (min {:?}, max {:?}); {} UIDs kept, \
                 scans cut short {}, UIDs not kept {}",
                times[10],
                times[0],
                times[20],
                pods.records.len(),
                pods.entries_dropped,
                pods.records_dropped
            );
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    #[test]
    fn a_garbled_dirent_buffer_ends_the_walk() {
        assert_eq!(dirents(&[0u8; 10]).count(), 0);
        // A record length of zero would loop forever: it ends the walk.
        assert_eq!(dirents(&[0u8; 40]).count(), 0);
    }
}
