//! The libraries the traced processes map, and the probes on them: which
//! files are probed, for which processes, until when (see
//! [`crate::probes::libraries`] for how a file is found and probed).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    num::NonZeroU32,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use ttft_trace_common::GpuCounters;

use super::{Change, launch_layer::LaunchLayer};
use crate::probes::{
    ProbeError, Probes, Reach, cuda,
    libraries::{self, FileId, Library, LibraryError, ReadStats, Scan, Scanner, TlsLibrary},
    openssl,
};

/// A library no scan has found mapped for this long, and not probed, is
/// forgotten (its file closed; see [`Scanner::forget_unused`]).
const UNUSED_LIBRARY: Duration = Duration::from_secs(60);

/// Most (process, file) pairs whose TLS library was logged; past it a new
/// one is logged at debug level (the set is emptied of exited processes).
const TLS_LOGGED_MAX: usize = 4_096;

pub(super) struct Libraries {
    scanner: Scanner,
    /// The probes fire host-wide rather than per traced process (see
    /// [`Libraries::reach`]).
    host_wide: bool,
    /// Files the scanner had inspected at the last
    /// [`Libraries::release_memory`].
    files_seen: usize,
    /// When a traced process was last seen mapping each probed file, and
    /// the files named by the user (kept however long no one maps them).
    last_mapped: HashMap<FileId, Instant>,
    named: HashSet<FileId>,
    /// The libraries named by the user, in `attach` mode: bound to each
    /// traced process.
    named_libs: Vec<Arc<Library>>,
    launches: LaunchLayer,
    /// The traced processes' TLS libraries already logged.
    tls_logged: HashSet<(u32, PathBuf)>,
}

impl Libraries {
    pub fn new(host_wide: bool) -> Self {
        Self {
            scanner: Scanner::default(),
            host_wide,
            files_seen: 0,
            last_mapped: HashMap::new(),
            named: HashSet::new(),
            named_libs: Vec::new(),
            launches: LaunchLayer::default(),
            tls_logged: HashSet::new(),
        }
    }

    /// Entries of its per-target tables: (table, entries).
    pub fn table_entries(&self) -> [(&'static str, usize); 2] {
        [
            ("library_files", self.scanner.files_seen()),
            ("probed_libraries", self.last_mapped.len()),
        ]
    }

    /// What the scanner gave up reading so far.
    pub fn read_stats(&self) -> ReadStats {
        self.scanner.read_stats()
    }

    /// The libraries process `pid` maps.
    pub fn scan(&mut self, pid: u32) -> Result<Scan, LibraryError> {
        self.scanner.scan(pid)
    }

    /// Which processes the probes put on a library for process `pid` fire
    /// in: `attach` binds them to each traced process, so that the other
    /// processes of the host that map the same file take no trap; `daemon`
    /// finds its workloads by what they call, so its probes fire host-wide
    /// (the kernel's filter drops what is not traced).
    fn reach(&self, pid: u32) -> Reach {
        match NonZeroU32::new(pid) {
            Some(pid) if !self.host_wide => Reach::Process(pid),
            _ => Reach::Host,
        }
    }

    /// Attaches the probes to `lib` for `reach` unless they are there.
    fn attach(
        probes: &mut Probes,
        lib: &Library,
        reach: Reach,
        changes: &mut Vec<Change>,
    ) -> Result<()> {
        if let Some(a) = probes.attach_library(lib, reach)? {
            changes.push(Change::Attached(a));
        }
        Ok(())
    }

    /// Takes the libraries named by `--cuda-lib`: a path that is no CUDA
    /// library is the user's error. Attached host-wide `at_once` (daemon);
    /// otherwise bound to each traced process at its scan, as found
    /// libraries are.
    pub fn attach_named(
        &mut self,
        probes: &mut Probes,
        paths: &[PathBuf],
        at_once: bool,
        changes: &mut Vec<Change>,
    ) -> Result<()> {
        for path in paths {
            let lib = libraries::inspect(path, path)?.with_context(|| {
                format!(
                    "{} defines none of the CUDA entry points ttft-trace probes \
                     (cudaLaunchKernel, cudaGraphLaunch or cuLaunchKernel)",
                    path.display()
                )
            })?;
            self.named.insert(lib.id.clone());
            if at_once {
                Self::attach(probes, &lib, Reach::Host, changes)?;
            } else {
                self.named_libs.push(Arc::new(lib));
            }
        }
        Ok(())
    }

    /// Attaches the probes to a library found in process `pid`'s mappings
    /// (or named). The process may exit meanwhile (its /proc path is then
    /// gone): a warning, and a later scan of another process tries again.
    pub fn attach_found(
        &mut self,
        probes: &mut Probes,
        lib: &Library,
        pid: u32,
        changes: &mut Vec<Change>,
    ) {
        self.attach_at(probes, lib, self.reach(pid), changes);
    }

    /// Attaches the probes of a TLS library that process `pid` maps, for
    /// that process only, whatever the mode: a TLS library never makes a
    /// workload, so no host-wide probe is wanted of it, and the host's other
    /// processes take no trap.
    fn attach_tls(
        &mut self,
        probes: &mut Probes,
        lib: &Library,
        pid: u32,
        changes: &mut Vec<Change>,
    ) {
        if lib.is(&openssl::OPENSSL_BIO) {
            probes.want_held_sends();
        }
        if let Some(pid) = NonZeroU32::new(pid) {
            self.attach_at(probes, lib, Reach::Process(pid), changes);
        }
    }

    fn attach_at(
        &mut self,
        probes: &mut Probes,
        lib: &Library,
        reach: Reach,
        changes: &mut Vec<Change>,
    ) {
        self.last_mapped.insert(lib.id.clone(), Instant::now());
        match Self::attach(probes, lib, reach, changes) {
            Ok(()) => {}
            Err(e) if matches!(e.downcast_ref(), Some(ProbeError::ProcessGone(_))) => {
                log::debug!("{e}");
            }
            Err(e) => log::warn!("could not attach to {}: {e:#}", lib.path.display()),
        }
    }

    /// Scans the `live` traced processes and attaches the probes to the
    /// libraries not probed for them yet.
    pub fn probe_live(
        &mut self,
        probes: &mut Probes,
        live: &[(u32, u32)],
        changes: &mut Vec<Change>,
    ) {
        self.launches.keep_live(live);
        for (pid, _) in live {
            self.probe_process(probes, *pid, changes);
        }
    }

    /// Attaches the probes to the libraries traced process `pid` maps (and,
    /// in `attach` mode, to the named ones) where they are not yet.
    pub fn probe_process(&mut self, probes: &mut Probes, pid: u32, changes: &mut Vec<Change>) {
        let Ok(scan) = self.scanner.scan(pid) else {
            return;
        };
        let named = self.named_libs.clone();
        let runtimes = scan.libraries.iter().chain(&named);
        let runtimes = runtimes.filter(|l| l.is(&cuda::RUNTIME));
        self.launches
            .note_runtimes(pid, runtimes.map(|l| l.id.clone()).collect());
        for lib in scan.libraries.iter().chain(&named) {
            self.attach_found(probes, lib, pid, changes);
        }
        for lib in &scan.tls_probes {
            // `libcrypto`'s record writes wait for the process to show a
            // memory BIO (an `SSL_write` that neither sent nor held): a
            // socket BIO's server never takes their trap. A file that is
            // `libssl` too (OpenSSL linked into one binary) has that part
            // probed now.
            if lib.is(&openssl::OPENSSL_BIO) && !probes.memory_bio_seen(pid) {
                let libssl = lib.without(&openssl::OPENSSL_BIO);
                if !libssl.apis.is_empty() {
                    self.attach_tls(probes, &libssl, pid, changes);
                }
                continue;
            }
            self.attach_tls(probes, lib, pid, changes);
        }
        let tls = scan.tls_read().map(|(p, l, r)| (p.clone(), l, r)).collect();
        self.log_tls(pid, tls);
    }

    /// Says once per traced process and file which TLS library it maps,
    /// and whether its plaintext is read (`read`); a connection whose TLS is
    /// not read is reported `tls_unsupported`.
    fn log_tls(&mut self, pid: u32, tls: Vec<(PathBuf, TlsLibrary, bool)>) {
        for (path, lib, read) in tls {
            let key = (pid, path);
            if self.tls_logged.contains(&key) {
                continue;
            }
            let line = format!(
                "pid {pid}: TLS via {} ({}): {}",
                lib.name(),
                key.1.display(),
                lib.reading(read)
            );
            if self.tls_logged.len() >= TLS_LOGGED_MAX {
                log::debug!("{line}");
            } else {
                log::info!("{line}");
                self.tls_logged.insert(key);
            }
        }
    }

    /// Detaches the probes bound to traced processes that exited, and (in
    /// daemon mode, every `unmapped` period) those of files no traced
    /// process maps; forgets the files no process maps.
    pub fn detach_gone(
        &mut self,
        probes: &mut Probes,
        live: &[(u32, u32)],
        unmapped: Option<Duration>,
        changes: &mut Vec<Change>,
    ) {
        let alive: HashSet<u32> = live.iter().map(|(pid, _)| *pid).collect();
        self.tls_logged.retain(|(pid, _)| alive.contains(pid));
        for a in probes.detach_processes(|pid| alive.contains(&pid)) {
            changes.push(Change::Detached(a));
        }
        if let Some(period) = unmapped {
            self.detach_unmapped(probes, period, changes);
        }
        let probed: HashSet<FileId> = probes.attached_files().cloned().collect();
        let named = &self.named;
        let forgotten = self.scanner.forget_unused(UNUSED_LIBRARY, |id| {
            probed.contains(id) || named.contains(id)
        });
        if forgotten > 0 {
            log::debug!("forgot {forgotten} libraries no process maps (their files closed)");
        }
    }

    /// Detaches the probes of files no traced process has mapped for
    /// `period` (every live process was scanned just before; one whose
    /// scan failed keeps nothing alive, but the period is far longer than
    /// a scan). The files named by the user stay probed.
    fn detach_unmapped(
        &mut self,
        probes: &mut Probes,
        period: Duration,
        changes: &mut Vec<Change>,
    ) {
        let unmapped: Vec<FileId> = probes
            .attached_files()
            .filter(|id| !self.named.contains(*id))
            .filter(|id| {
                self.last_mapped
                    .get(*id)
                    .is_none_or(|t| t.elapsed() >= period)
            })
            .cloned()
            .collect();
        for id in unmapped {
            self.last_mapped.remove(&id);
            self.launches.forget_file(&id);
            if let Some(a) = probes.detach_library(&id) {
                changes.push(Change::Detached(a));
            }
        }
    }

    /// How many probed files define the CUDA runtime, and the driver.
    pub fn probed_cuda(probes: &Probes) -> (usize, usize) {
        let (mut runtime_libs, mut driver_libs) = (0, 0);
        for a in probes.attached() {
            runtime_libs += usize::from(a.apis.contains(&&cuda::RUNTIME));
            driver_libs += usize::from(a.apis.contains(&&cuda::DRIVER));
        }
        (runtime_libs, driver_libs)
    }

    /// Chooses the layer launches are probed at (see [`LaunchLayer`]), from
    /// a reading of the kernel's counters; `gone` left the counters.
    pub fn choose_launch_layer(
        &mut self,
        probes: &mut Probes,
        reading: &BTreeMap<u32, GpuCounters>,
        gone: &[u32],
    ) {
        for tgid in gone {
            self.launches.forget_process(*tgid);
        }
        self.launches.choose(probes, reading, self.host_wide);
    }

    /// Every file the `live` processes map, and those this process may not
    /// open, for the error that says what was searched.
    pub fn searched(&mut self, live: &[(u32, u32)]) -> (BTreeSet<PathBuf>, BTreeSet<PathBuf>) {
        let mut searched = BTreeSet::new();
        let mut denied = BTreeSet::new();
        for (pid, _) in live {
            if let Ok(scan) = self.scanner.scan(*pid) {
                searched.extend(scan.searched);
                denied.extend(scan.denied);
            }
        }
        (searched, denied)
    }

    /// Hands the heap freed after inspecting new files, or after a
    /// workload ended (`workload_ended`: its connections, requests and
    /// label sets), back to the system. Reading an ELF file's symbol tables
    /// (tens of MiB for a Python or PyTorch library) leaves the allocator's
    /// arenas that large for good otherwise: the daemon's RSS stayed at its
    /// high-water mark, and did not show what it holds.
    pub fn release_memory(&mut self, workload_ended: bool) {
        let seen = self.scanner.files_seen();
        if seen != self.files_seen || workload_ended {
            self.files_seen = seen;
            // SAFETY: malloc_trim(3) has no preconditions; 0 keeps no pad.
            unsafe { libc::malloc_trim(0) };
        }
    }
}
