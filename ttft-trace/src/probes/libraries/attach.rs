//! Attaching the uprobes to the libraries found, per file and reach, and
//! detaching them.

use std::{collections::BTreeMap, num::NonZeroU32, path::PathBuf};

use aya::{
    Ebpf,
    programs::{
        UProbe,
        uprobe::{UProbeLinkId, UProbeScope},
    },
};

use super::{FileId, Library};
use crate::probes::{
    ProbeError, Probes,
    symbols::{Family, ProbedSymbol},
};

/// What attaching one library did.
#[derive(Debug, Clone)]
pub struct Attached {
    pub path: PathBuf,
    /// The families (APIs) of the file ([`Library::apis`]).
    pub apis: Vec<&'static Family>,
    /// Symbols probed.
    pub symbols: usize,
    /// Symbols whose attach failed, with the reason.
    pub failed: Vec<(String, String)>,
    /// How long creating the uprobes took.
    pub attach_ms: f64,
}

/// Which processes a library's uprobes fire in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reach {
    /// Every process that maps the file (`daemon`: workloads are found by
    /// what they call).
    Host,
    /// One process (`attach`): the kernel plants the breakpoints in that
    /// process's memory only, so another process mapping the same file
    /// takes no trap at all.
    Process(NonZeroU32),
}

type Links = Vec<(&'static str, UProbeLinkId)>;

/// One file's probes: what was attached, and per reach the families
/// attached and the links to detach them by.
pub(in crate::probes) struct Probed {
    report: Attached,
    links: BTreeMap<Reach, ReachProbes>,
}

/// The probes of one file for one reach.
#[derive(Default)]
struct ReachProbes {
    families: Vec<&'static Family>,
    links: Links,
}

impl Probes {
    /// Attaches the probes to one library for `reach`, once per file,
    /// family and reach: a file attached for some of its families (OpenSSL
    /// linked into one binary, whose `libcrypto` table waits for a memory
    /// BIO) gets the others' probes when they come. Returns the report when
    /// families new to the file were probed, None after (another process,
    /// or the same again).
    pub fn attach_library(
        &mut self,
        lib: &Library,
        reach: Reach,
    ) -> Result<Option<Attached>, ProbeError> {
        // The real file's identity: one set of probes per reach however
        // many mount namespaces or overlays show it.
        // Checked on every rescan: no allocation until something is new.
        let probed = self.attached.get(&lib.id);
        let in_reach = |f: &&'static Family| {
            probed
                .and_then(|p| p.links.get(&reach))
                .is_some_and(|r| r.families.contains(f))
        };
        if lib.apis.iter().all(in_reach) {
            return Ok(None);
        }
        let new: Vec<&'static Family> = lib.apis.iter().copied().filter(|f| !in_reach(f)).collect();
        let in_file = |f: &&'static Family| probed.is_some_and(|p| p.report.apis.contains(f));
        let new_to_file: Vec<&'static Family> =
            new.iter().copied().filter(|f| !in_file(f)).collect();
        let started = std::time::Instant::now();
        let mut report = Attached {
            path: lib.path.clone(),
            apis: new.clone(),
            symbols: 0,
            failed: Vec::new(),
            attach_ms: 0.0,
        };
        let mut links = Vec::new();
        let of_new = |sym: &ProbedSymbol| new.iter().any(|f| f.owns(sym));
        for (sym, offset) in lib.symbols.iter().filter(|(sym, _)| of_new(sym)) {
            match self.attach_symbol(sym, *offset, lib, reach) {
                Ok(mut attached) => {
                    report.symbols += 1;
                    links.append(&mut attached);
                }
                Err(e @ (ProbeError::UprobeDenied { .. } | ProbeError::ProcessGone(_))) => {
                    // Every other symbol would fail the same way: say why,
                    // once, and leave none of this attach's probes behind.
                    self.detach_links(links);
                    return Err(e);
                }
                Err(e) => report.failed.push((sym.name.to_string(), e.to_string())),
            }
        }
        report.attach_ms = started.elapsed().as_secs_f64() * 1e3;
        let Some(probed) = self.attached.get_mut(&lib.id) else {
            let probed = Probed {
                report: report.clone(),
                links: BTreeMap::from([(
                    reach,
                    ReachProbes {
                        families: new,
                        links,
                    },
                )]),
            };
            self.attached.insert(lib.id.clone(), probed);
            return Ok(Some(report));
        };
        let r = probed.links.entry(reach).or_default();
        r.families.extend(new.iter().copied());
        r.links.append(&mut links);
        log::debug!(
            "probes on {} for {reach:?} in {:.1} ms",
            lib.path.display(),
            report.attach_ms
        );
        if new_to_file.is_empty() {
            return Ok(None);
        }
        probed.report.apis.extend(new_to_file);
        Ok(Some(report))
    }

    /// Detaches the probes of one file (no traced process maps it any
    /// more). The kernel takes about 0.1 s per uprobe to remove it (see
    /// [`detach_in_background`]): the links are closed on a thread of their
    /// own, so the event loop does not wait.
    pub fn detach_library(&mut self, id: &FileId) -> Option<Attached> {
        let probed = self.attached.remove(id)?;
        self.detach_links(probed.links.into_values().flat_map(|r| r.links).collect());
        Some(probed.report)
    }

    /// Detaches the probes bound to processes `keep` rejects (they
    /// exited); returns the files left with no probes at all, detached.
    pub fn detach_processes(&mut self, keep: impl Fn(u32) -> bool) -> Vec<Attached> {
        let mut gone = Vec::new();
        let mut emptied = Vec::new();
        for (id, probed) in &mut self.attached {
            probed.links.retain(|reach, r| match reach {
                Reach::Process(pid) if !keep(pid.get()) => {
                    gone.append(&mut r.links);
                    false
                }
                _ => true,
            });
            if probed.links.is_empty() {
                emptied.push(id.clone());
            }
        }
        self.detach_links(gone);
        emptied
            .iter()
            .filter_map(|id| self.attached.remove(id))
            .map(|p| p.report)
            .collect()
    }

    fn detach_links(&mut self, links: Links) {
        let owned: Vec<_> = links
            .into_iter()
            .filter_map(|(program, id)| uprobe(&mut self.ebpf, program).ok()?.take_link(id).ok())
            .collect();
        if owned.is_empty() {
            return;
        }
        let spawned = std::thread::Builder::new()
            .name("ttft-detach-lib".into())
            .spawn(move || drop(owned));
        if let Err(e) = spawned {
            log::warn!("detaching on the event loop's thread ({e})");
        }
    }

    /// Detaches the probes of the programs `which` picks that are bound to
    /// `reach` (of one file, or of all), leaving the rest of each file's
    /// probes; a family's policy says which (the CUDA launch layer: the
    /// runtime's launches). Returns how many were detached.
    pub fn detach_programs(
        &mut self,
        reach: Reach,
        file: Option<&FileId>,
        which: impl Fn(&str) -> bool,
    ) -> usize {
        let mut dropped = Vec::new();
        for (id, probed) in &mut self.attached {
            if file.is_some_and(|f| f != id) {
                continue;
            }
            if let Some(ReachProbes { links, .. }) = probed.links.get_mut(&reach) {
                let (picked, rest): (Links, Links) = std::mem::take(links)
                    .into_iter()
                    .partition(|(program, _)| which(program));
                *links = rest;
                dropped.extend(picked);
            }
        }
        let n = dropped.len();
        self.detach_links(dropped);
        n
    }

    /// The path a probed file was attached by.
    pub fn attached_path(&self, id: &FileId) -> Option<&std::path::Path> {
        self.attached.get(id).map(|p| p.report.path.as_path())
    }

    /// The files probed now.
    pub fn attached_files(&self) -> impl Iterator<Item = &FileId> {
        self.attached.keys()
    }

    /// Entry and (where needed) return probe of one symbol: both or neither,
    /// since the runtime nesting depth counts entries against returns. The
    /// return probe goes first: a call that enters between the two attaches
    /// then shows only its return, which the depth ignores, whereas an
    /// entry without its return would leave the thread's depth raised for
    /// good and every later runtime call taken for a nested one (attaching
    /// takes long while another tracer detaches: the kernel serialises it).
    fn attach_symbol(
        &mut self,
        sym: &ProbedSymbol,
        offset: u64,
        lib: &Library,
        reach: Reach,
    ) -> Result<Links, ProbeError> {
        let scope = match reach {
            Reach::Host => UProbeScope::AllProcesses,
            Reach::Process(pid) => UProbeScope::OneProcess(pid),
        };
        let mut links = Vec::with_capacity(2);
        if let Some(ret_name) = sym.returns {
            let ret = uprobe(&mut self.ebpf, ret_name)?;
            let link = ret
                .attach(offset, &lib.open_path, scope)
                .map_err(|e| uprobe_error(ret_name, &lib.path, reach, e))?;
            links.push((ret_name, link));
        }
        let entry = uprobe(&mut self.ebpf, sym.program)?;
        match entry.attach(offset, &lib.open_path, scope) {
            Ok(link) => links.push((sym.program, link)),
            Err(e) => {
                self.detach_links(links);
                return Err(uprobe_error(sym.program, &lib.path, reach, e));
            }
        }
        Ok(links)
    }

    pub fn attached(&self) -> impl Iterator<Item = &Attached> {
        self.attached.values().map(|p| &p.report)
    }
}

/// A uprobe attach error; a permission error of perf_event_open names the
/// capability the kernel wants.
pub(in crate::probes) fn uprobe_error(
    program: &'static str,
    path: &std::path::Path,
    reach: Reach,
    e: aya::programs::ProgramError,
) -> ProbeError {
    if let aya::programs::ProgramError::SyscallError(aya::sys::SyscallError { call, io_error }) = &e
        && *call == "perf_event_open"
        && let (Reach::Process(pid), Some(libc::ESRCH)) = (reach, io_error.raw_os_error())
    {
        return ProbeError::ProcessGone(pid.get());
    }
    if let aya::programs::ProgramError::SyscallError(aya::sys::SyscallError { call, io_error }) = &e
        && *call == "perf_event_open"
        && matches!(io_error.raw_os_error(), Some(libc::EACCES | libc::EPERM))
    {
        return ProbeError::UprobeDenied {
            path: path.to_path_buf(),
            caps: crate::host::caps::CapSet::effective().unwrap_or_default(),
            source: std::io::Error::from_raw_os_error(io_error.raw_os_error().unwrap_or(0)),
        };
    }
    ProbeError::Program(program, e)
}

pub(in crate::probes) fn uprobe<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut UProbe, ProbeError> {
    ebpf.program_mut(name)
        .ok_or(ProbeError::Missing(name))?
        .try_into()
        .map_err(|e| ProbeError::Program(name, e))
}
