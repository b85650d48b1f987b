//! Scanning processes' mappings for libraries to probe, remembering what
//! each file turned out to be.

use std::{
    collections::HashMap,
    fs::File,
    hash::{Hash, Hasher},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use super::{
    FileId, Library, LibraryError, TlsLibrary, elf, maps,
    quarantine::{Quarantine, Target},
};
use crate::{
    host::deadline::{self, Overdue, TargetWork, WorkStats},
    workloads::quota::{Quota, Resource, Tenant},
};

/// Most files remembered by a [`Scanner`]; past that, what it remembers of
/// files that are no library to probe (or failed) is forgotten.
const SCANNER_CACHE_MAX: usize = 65_536;

/// How long a file that is no library to probe (or that may not be opened)
/// is remembered after the last scan that found it mapped. Long enough that
/// a host's usual libraries are not read again and again (a large one's
/// symbol tables are tens of MiB), short enough that an inode number freed
/// and reused for a CUDA library under the same name is inspected again.
const OTHER_FILE_AGE: Duration = Duration::from_secs(600);

/// A read of a target's files (its maps, a file it maps) that makes no
/// progress for this long is abandoned: a file on a stalled FUSE or NFS
/// mount. Far above a read of a local disk's, or of a 16 MiB maps file in
/// 64 KiB reads; short enough that one stall keeps /metrics and signals
/// waiting under a second.
const READ_STALL: Duration = Duration::from_millis(500);
/// Threads left stuck in such reads at most; past that, scans are refused
/// until one returns (each holds a stack and the stalled file).
const STUCK_READERS_MAX: usize = 8;
/// Of those, the most one tenant's (pod, else cgroup) reads may hold:
/// past it, its processes are not read until one of its reads returns, so
/// that one pod's processes on stalled mounts cannot take every reader
/// and leave the host's new workloads unfound.
const STUCK_READERS_PER_TENANT: usize = 2;

/// What one scan of a process found.
#[derive(Debug, Default)]
pub struct Scan {
    pub libraries: Vec<Arc<Library>>,
    /// Every mapped file that was looked at (for the "nothing found" error).
    pub searched: Vec<PathBuf>,
    /// Mapped files this process may not open (permission denied).
    pub denied: Vec<PathBuf>,
    /// The TLS libraries it maps, by the file that carries each.
    pub tls: Vec<(PathBuf, TlsLibrary)>,
    /// Of those, the ones whose plaintext is read: the probes to bind to
    /// this process ([`crate::probes::symbols::TLS_FAMILIES`]).
    pub tls_probes: Vec<Arc<Library>>,
}

impl Scan {
    /// The TLS libraries it maps, each with whether its plaintext probes
    /// were found (see [`TlsLibrary::reading`]).
    pub fn tls_read(&self) -> impl Iterator<Item = (&PathBuf, TlsLibrary, bool)> {
        self.tls.iter().map(|(path, lib)| {
            let probed = self.tls_probes.iter().any(|p| &p.path == path);
            (path, *lib, probed)
        })
    }
}

/// What a file turned out to be.
#[derive(Debug, Clone)]
enum Seen {
    Library(Arc<Library>),
    /// No library to probe, but a TLS library (or OpenSSL's `libcrypto`,
    /// which names none), with the probes that read its plaintext where
    /// it is one read: not tried again.
    Tls(Option<TlsLibrary>, Option<Arc<Library>>),
    /// No library to probe, or a file that cannot be inspected (not regular,
    /// not the mapped file, unreadable): not tried again.
    Other,
    /// A file over a cap on the ELF work it asks for (the cap named as in
    /// `ttft_trace_libraries_refused_total`): not tried again.
    OverCap(&'static str),
    /// A file we may not open.
    Denied,
}

/// What the scanner remembers of one file (by the device and inode of its
/// mapping).
#[derive(Debug)]
struct Entry {
    seen: Seen,
    /// A hash of the path the file was last found under, and its stamp
    /// when inspected (None: it could not be opened): the same device and
    /// inode under another name with another stamp is another file (an
    /// inode number freed and given to a new file), inspected again.
    path: u64,
    stamp: Option<Stamp>,
    /// When a scan last found the file mapped.
    last_found: Instant,
}

/// What a file's metadata says of its content: the same inode with the
/// same stamp holds the same file (a new file in a reused inode number has
/// its own change time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(file: &File) -> Option<Self> {
        let meta = file.metadata().ok()?;
        Some(Self {
            size: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        })
    }
}

/// Scans processes' mappings, remembering what each file (by the device
/// and inode of its mapping) turned out to be, so that rescans cost a read
/// of /proc/PID/maps. No entry outlives the file it describes for long:
/// a library holds its file open (its inode cannot be reused while it is
/// remembered); any other entry goes once no scan has found its file
/// mapped for a while (see [`Scanner::forget_unused`]), or when its device
/// and inode show up under another path with another stamp.
///
/// Every read of a target's files runs off the caller's thread with a
/// deadline on progress ([`TargetWork`]); a process or file whose read did
/// not return is set aside with backoff ([`Quarantine`]).
pub struct Scanner {
    cache: HashMap<(u64, u64), Entry>,
    work: TargetWork,
    quarantine: Quarantine,
    /// Each tenant's share of the stuck readers.
    stuck_share: Quota<Tenant>,
    /// Files refused for a cap on ELF work, by cap (each once: remembered).
    refused: HashMap<&'static str, u64>,
}

impl Default for Scanner {
    fn default() -> Self {
        Self {
            cache: HashMap::new(),
            work: TargetWork::new(READ_STALL, STUCK_READERS_MAX),
            quarantine: Quarantine::default(),
            stuck_share: Quota::new(Resource::StuckReads, STUCK_READERS_PER_TENANT),
            refused: HashMap::new(),
        }
    }
}

/// What the scanner gave up reading, for the metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReadStats {
    pub work: WorkStats,
    /// Processes and files set aside now or lately.
    pub set_aside: usize,
    /// Those that could not be set aside (the table full).
    pub set_aside_overflowed: u64,
    /// Files refused for a cap on the ELF work they ask for: over 256 MiB
    /// of headers and symbol tables or 4 million symbols, and a probed
    /// name at too many addresses.
    pub too_large: u64,
    pub too_many_copies: u64,
    /// Scans refused to a tenant at its share of the stuck readers.
    pub stuck_share_refused: u64,
}

impl Scanner {
    /// Files inspected and remembered so far.
    pub fn files_seen(&self) -> usize {
        self.cache.len()
    }

    /// What the scanner gave up reading so far.
    pub fn read_stats(&self) -> ReadStats {
        ReadStats {
            work: self.work.stats(),
            set_aside: self.quarantine.held(),
            set_aside_overflowed: self.quarantine.overflowed,
            too_large: self.refused.get("too_large").copied().unwrap_or(0),
            too_many_copies: self.refused.get("too_many_copies").copied().unwrap_or(0),
            stuck_share_refused: self.stuck_share.exceeded,
        }
    }

    /// The libraries process `pid` maps, each file inspected once. A
    /// process set aside after a read that did not return is not read.
    /// Two hand-overs to the worker at most: the maps, then every file the
    /// cache cannot vouch for, in one piece of work (a hand-over waits for
    /// the worker to be scheduled: on a busy machine, a hand-over a file
    /// made a new workload's first scan several times slower).
    pub fn scan(&mut self, pid: u32) -> Result<Scan, LibraryError> {
        let now = Instant::now();
        if self.quarantine.holds(Target::Process(pid), now) {
            return Err(LibraryError::SetAside(pid));
        }
        self.admit_tenant(pid)?;
        let files = self.off_loop(pid, || None, move || maps::mapped_files(pid))??;
        let mut scan = Scan::default();
        let mut slots = Vec::with_capacity(files.len());
        let mut reads = Vec::new();
        for mapped in files {
            scan.searched.push(mapped.path.clone());
            let key = (mapped.dev, mapped.inode);
            if self.quarantine.holds(Target::File(key.0, key.1), now) {
                continue;
            }
            let path = path_hash(&mapped.path);
            match self.cache.get_mut(&key) {
                // The same path; or a library, which holds its file open
                // (its inode number cannot be given to another file).
                Some(e)
                    if e.path == path
                        || matches!(e.seen, Seen::Library(_) | Seen::Tls(_, Some(_))) =>
                {
                    e.path = path;
                    e.last_found = now;
                    slots.push(Slot::Known(e.seen.clone(), mapped.path));
                }
                // Another file's stamp is checked (an open and an fstat, no
                // ELF read); a file not remembered is inspected.
                entry => {
                    let expect = entry.and_then(|e| e.stamp);
                    slots.push(Slot::Read);
                    reads.push((mapped, expect));
                }
            }
        }
        let mut found = if reads.is_empty() {
            Vec::new()
        } else {
            let current = Arc::new(Mutex::new(None));
            let reading = current.clone();
            let stalled_on = move || current.lock().ok().and_then(|c| *c);
            self.off_loop(pid, stalled_on, move || read_files(reads, &reading))?
        }
        .into_iter();
        for slot in slots {
            let (seen, path) = match slot {
                Slot::Known(seen, path) => (seen, path),
                Slot::Read => {
                    let Some((mapped, read)) = found.next() else {
                        break;
                    };
                    let path = mapped.path.clone();
                    match self.apply(mapped, read, now) {
                        Some(seen) => (seen, path),
                        None => continue,
                    }
                }
            };
            match seen {
                Seen::Library(lib) => {
                    if let Some(tls) = lib.tls {
                        scan.tls.push((path, tls));
                    }
                    scan.libraries.push(lib);
                }
                Seen::Tls(tls, probes) => {
                    if let Some(tls) = tls {
                        scan.tls.push((path, tls));
                    }
                    scan.tls_probes.extend(probes);
                }
                Seen::Denied => scan.denied.push(path),
                Seen::Other | Seen::OverCap(_) => {}
            }
        }
        Ok(scan)
    }

    /// Whether `pid`'s tenant may have its files read: not while its reads
    /// hold its share of the stuck readers (a refusal counted, the tenant
    /// warned about once while it stays at its share). Its cgroup is read
    /// only while some tenant is at its share: a read stuck for good on a
    /// host costs the other scans nothing.
    fn admit_tenant(&mut self, pid: u32) -> Result<(), LibraryError> {
        let at_share = self.quarantine.tenants_holding(self.stuck_share.share());
        self.stuck_share.settle(|t| at_share.contains(t));
        if at_share.is_empty() {
            return Ok(());
        }
        let Some(tenant) = Tenant::of_process(pid) else {
            return Ok(());
        };
        let held = self.quarantine.stuck_of(&tenant);
        if self.stuck_share.admit(&tenant, held) {
            return Ok(());
        }
        Err(LibraryError::TenantStuck {
            pid,
            tenant: tenant.to_string(),
            held,
        })
    }

    /// Records what the worker read of `mapped`; what it is, or None where
    /// the failure was the process's (the next scan reads it again).
    fn apply(&mut self, mapped: maps::MappedFile, read: Read, now: Instant) -> Option<Seen> {
        let key = (mapped.dev, mapped.inode);
        let path = path_hash(&mapped.path);
        match read {
            Read::Same => {
                let e = self.cache.get_mut(&key)?;
                e.path = path;
                e.last_found = now;
                Some(e.seen.clone())
            }
            Read::Inspected(None) => None,
            Read::Inspected(Some((seen, stamp))) => {
                if let Seen::OverCap(cap) = seen {
                    *self.refused.entry(cap).or_default() += 1;
                }
                self.remember(
                    key,
                    Entry {
                        seen: seen.clone(),
                        path,
                        stamp,
                        last_found: now,
                    },
                );
                Some(seen)
            }
        }
    }

    /// Runs a read of process `pid`'s files off this thread; one that does
    /// not return sets the process aside, and the file `stalled_on` names
    /// (the one being read then, if any).
    fn off_loop<T: Send + 'static>(
        &mut self,
        pid: u32,
        stalled_on: impl FnOnce() -> Option<(u64, u64)>,
        read: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, LibraryError> {
        let returned = Arc::new(AtomicBool::new(false));
        let done = returned.clone();
        let why = match self.work.run(move || {
            let v = read();
            done.store(true, Ordering::SeqCst);
            v
        }) {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        if let Overdue::Stalled(_) = why {
            let now = Instant::now();
            let mut targets = vec![Target::Process(pid)];
            targets.extend(stalled_on().map(|(dev, ino)| Target::File(dev, ino)));
            let mut aside = Duration::ZERO;
            for t in &targets {
                aside = self.quarantine.add(*t, now);
            }
            // Held while the read is stuck: one thread per target at most,
            // counted toward its tenant's share.
            let tenant = Tenant::of_process(pid);
            self.quarantine.add_stuck(targets, tenant, returned);
            log::warn!(
                "pid {pid}: a read of its files: {why}; set aside until it returns, then {aside:?}"
            );
        } else {
            log::debug!("pid {pid}: not read: {why}");
        }
        Err(LibraryError::Overdue { pid, why })
    }

    /// Forgets the libraries no scan has found mapped for `library_age`,
    /// unless `keep` says their file is probed: each holds its file open,
    /// and the files of a host's CUDA processes come and go (image updates,
    /// copies in temporary directories): a deleted file would stay on the
    /// disk, and the descriptors would add up. Forgets any other file not
    /// found for [`OTHER_FILE_AGE`]: its inode may since belong to another
    /// file. Returns how many libraries were forgotten.
    pub fn forget_unused(
        &mut self,
        library_age: Duration,
        keep: impl Fn(&FileId) -> bool,
    ) -> usize {
        self.forget_unused_at(Instant::now(), library_age, keep)
    }

    fn forget_unused_at(
        &mut self,
        now: Instant,
        library_age: Duration,
        keep: impl Fn(&FileId) -> bool,
    ) -> usize {
        let mut libraries = 0;
        self.cache.retain(|_, entry| {
            let age = now.saturating_duration_since(entry.last_found);
            match &entry.seen {
                Seen::Library(lib) | Seen::Tls(_, Some(lib)) => {
                    let stays = keep(&lib.id) || age < library_age;
                    libraries += usize::from(!stays);
                    stays
                }
                Seen::Tls(..) | Seen::Other | Seen::OverCap(_) | Seen::Denied => {
                    age < OTHER_FILE_AGE
                }
            }
        });
        libraries
    }

    /// Remembers a file; past [`SCANNER_CACHE_MAX`], forgets every file
    /// that is no library (libraries are few, and hold the probes' files).
    fn remember(&mut self, key: (u64, u64), entry: Entry) {
        if self.cache.len() >= SCANNER_CACHE_MAX {
            self.cache.retain(|_, e| matches!(e.seen, Seen::Library(_)));
        }
        self.cache.insert(key, entry);
    }
}

/// The stamp of the file of `mapped`, if it can be opened.
fn stamp_of_mapped(mapped: &maps::MappedFile) -> Option<Stamp> {
    maps::open_mapped(mapped).ok().and_then(|f| Stamp::of(&f))
}

/// A mapped file in a scan: told by the cache, or read by the worker.
enum Slot {
    Known(Seen, PathBuf),
    Read,
}

/// What the worker read of a file: still the file remembered (its stamp
/// unchanged), or inspected (None: the process's failure).
enum Read {
    Same,
    Inspected(Option<(Seen, Option<Stamp>)>),
}

/// On the worker: each file's stamp checked against the one remembered, or
/// the file inspected; `reading` names the file being read (for the set
/// aside, should a read not return).
fn read_files(
    files: Vec<(maps::MappedFile, Option<Stamp>)>,
    reading: &Mutex<Option<(u64, u64)>>,
) -> Vec<(maps::MappedFile, Read)> {
    files
        .into_iter()
        .map(|(mapped, expect)| {
            if let Ok(mut r) = reading.lock() {
                *r = Some((mapped.dev, mapped.inode));
            }
            let read = match expect {
                Some(stamp) if stamp_of_mapped(&mapped) == Some(stamp) => Read::Same,
                _ => Read::Inspected(inspect_mapped(&mapped)),
            };
            deadline::progress();
            (mapped, read)
        })
        .collect()
}

/// A hash of a path, to tell a name from another without keeping it.
fn path_hash(path: &Path) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    path.hash(&mut h);
    h.finish()
}

/// What a mapped file is, with its stamp where it could be opened, or None
/// where the failure was the process's (not remembered).
fn inspect_mapped(mapped: &maps::MappedFile) -> Option<(Seen, Option<Stamp>)> {
    let mut stamp = None;
    let inspected = maps::open_mapped(mapped).and_then(|file| {
        stamp = Stamp::of(&file);
        elf::inspect_file(&mapped.path, file)
    });
    let seen = match inspected {
        // A CUDA library that carries OpenSSL too is probed as the CUDA
        // library it is (its TLS is named, not read).
        Ok(elf::Inspected {
            library: Some(lib), ..
        }) => Seen::Library(Arc::new(lib)),
        Ok(elf::Inspected {
            library: None,
            tls,
            tls_probes,
        }) if tls.is_some() || tls_probes.is_some() => Seen::Tls(tls, tls_probes.map(Arc::new)),
        Ok(elf::Inspected { .. }) => Seen::Other,
        Err(e) if e.is_transient() => return None,
        Err(e) => {
            // A file over a cap is worth an operator's eye (a hostile or
            // broken library is left unprobed); it is remembered, so this
            // is said once per file.
            if let Some(cap) = e.over_cap() {
                log::warn!("not probing {}: {e}", mapped.path.display());
                Seen::OverCap(cap)
            } else {
                log::debug!("not inspecting {}: {e}", mapped.path.display());
                if e.is_permission() {
                    Seen::Denied
                } else {
                    Seen::Other
                }
            }
        }
    };
    Some((seen, stamp))
}

#[cfg(test)]
mod tests;
