//! What the toggle bench ([`crate::hooktoggle`]) switches: the
//! raw-tracepoint programs of a setup and where each gets its second link,
//! found in the tracer's own links (by the bpf() syscall), loaded from its
//! object, or the empty floor program.

use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::CString,
    os::fd::OwnedFd,
    path::Path,
};

use anyhow::Result;

use crate::{
    bpfobj::{
        BPF_LINK_TYPE_PERF_EVENT, BPF_LINK_TYPE_RAW_TRACEPOINT, BPF_PROG_GET_FD_BY_ID,
        BPF_PROG_TYPE_TRACING, held_links, link, link_ids, open_id, prog_info,
    },
    rawfloor, tracerprogs,
};

/// What a setup switches: programs, and where each gets its second link.
#[derive(Default)]
pub(crate) struct Hooks {
    /// Name and fd of each program.
    pub(crate) progs: Vec<(String, OwnedFd)>,
    /// Index in `progs` and the tracepoint's name (`None` for a `tp_btf`
    /// program) of each link to make.
    pub(crate) links: Vec<(usize, Option<CString>)>,
    /// "program@tracepoint" of each link, for the report.
    pub(crate) labels: Vec<String>,
    /// The tracer's links left alone, and why.
    pub(crate) skipped: Vec<String>,
    /// Links that stay on throughout (`floor_second`'s first copy).
    _base: Vec<OwnedFd>,
}

impl Hooks {
    /// Makes every link; closing them all undoes it.
    pub(crate) fn attach(&self) -> Result<Vec<OwnedFd>> {
        self.links
            .iter()
            .map(|(p, tp)| rawfloor::raw_tp_open(&self.progs[*p].1, tp.as_deref()))
            .collect()
    }

    /// The empty program, on each of the floor's tracepoints; with
    /// `second`, on top of a first link of it there that stays.
    pub(crate) fn floor(second: bool) -> Result<Self> {
        let mut hooks = Self::default();
        hooks.progs.push((rawfloor::NAME.into(), rawfloor::load()?));
        for tp in rawfloor::TRACEPOINTS {
            hooks.links.push((0, Some(CString::new(*tp)?)));
            hooks.labels.push(format!("{}@{tp}", rawfloor::NAME));
        }
        if second {
            hooks._base = hooks.attach()?;
        }
        Ok(hooks)
    }

    /// The tracer's own programs, loaded fresh from its object with no
    /// tracer running (see [`crate::tracerprogs`]): switched from none to
    /// one link.
    pub(crate) fn programs(root: &Path, set: tracerprogs::Set) -> Result<Self> {
        let mut hooks = Self::default();
        for (name, fd, tp) in tracerprogs::load(root, set)? {
            let at = tp.as_ref().map_or("its BTF tracepoint".into(), |t| {
                t.to_string_lossy().into_owned()
            });
            hooks.labels.push(format!("{name}@{at}"));
            hooks.progs.push((name, fd));
            hooks.links.push((hooks.progs.len() - 1, tp));
        }
        Ok(hooks)
    }

    /// The raw-tracepoint programs of the links made since `before` that
    /// process `pid` holds (the tracer's: another tracer may start
    /// meanwhile, a test's).
    pub(crate) fn tracer(before: &BTreeSet<u32>, pid: u32) -> Result<Self> {
        let mut hooks = Self::default();
        let mut by_id: BTreeMap<u32, (usize, bool)> = BTreeMap::new();
        let (mut uprobes, mut tracepoints) = (0, Vec::new());
        let held = held_links(pid)?;
        let new: BTreeSet<u32> = link_ids()?.difference(before).copied().collect();
        let others = new.difference(&held).count();
        if others > 0 {
            hooks.skipped.push(format!(
                "{others} links made meanwhile by other processes (another tracer?)"
            ));
        }
        for &id in new.intersection(&held) {
            let Some(l) = link(id)? else { continue };
            match l.kind {
                BPF_LINK_TYPE_RAW_TRACEPOINT => {
                    let (p, btf) = match by_id.get(&l.prog_id) {
                        Some(&p) => p,
                        None => {
                            let Some(fd) = open_id(BPF_PROG_GET_FD_BY_ID, l.prog_id)? else {
                                continue;
                            };
                            let (kind, name, _) = prog_info(&fd)?;
                            hooks.progs.push((name, fd));
                            let p = (hooks.progs.len() - 1, kind == BPF_PROG_TYPE_TRACING);
                            by_id.insert(l.prog_id, p);
                            p
                        }
                    };
                    hooks
                        .labels
                        .push(format!("{}@{}", hooks.progs[p].0, l.name));
                    let tp = if btf {
                        None
                    } else {
                        Some(CString::new(l.name)?)
                    };
                    hooks.links.push((p, tp));
                }
                // enum bpf_perf_event_type: 1 uprobe, 2 uretprobe, 5
                // tracepoint.
                BPF_LINK_TYPE_PERF_EVENT if matches!(l.perf_kind, 1 | 2) => uprobes += 1,
                BPF_LINK_TYPE_PERF_EVENT if l.perf_kind == 5 => tracepoints.push(l.name),
                kind => hooks.skipped.push(format!(
                    "link {id} of type {kind} ({}): not a raw tracepoint",
                    l.name
                )),
            }
        }
        if uprobes > 0 {
            hooks.skipped.push(format!(
                "{uprobes} uprobes and uretprobes (perf-event links: closing one takes 64-84 ms \
                 here, too slow to switch)"
            ));
        }
        if !tracepoints.is_empty() {
            hooks.skipped.push(format!(
                "classic tracepoints {} (perf-event links, too slow to switch; rare events)",
                tracepoints.join(", ")
            ));
        }
        Ok(hooks)
    }
}
