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

use anyhow::{Context as _, Result};

use crate::{
    bpfobj::{
        BPF_LINK_TYPE_CGROUP, BPF_LINK_TYPE_PERF_EVENT, BPF_LINK_TYPE_RAW_TRACEPOINT,
        BPF_PROG_GET_FD_BY_ID, BPF_PROG_TYPE_TRACING, held_links, link, link_ids, open_id,
        prog_info,
    },
    cgroup2::{self, BPF_CGROUP_INET_INGRESS, BenchCgroup},
    rawfloor,
    tracerprogs::{self, Target},
};

/// What a setup switches: programs, and where each gets its second link.
#[derive(Default)]
pub(crate) struct Hooks {
    /// Name and fd of each program.
    pub(crate) progs: Vec<(String, OwnedFd)>,
    /// Index in `progs` and where each link to make goes.
    pub(crate) links: Vec<(usize, Target)>,
    /// "program@tracepoint" of each link, for the report.
    pub(crate) labels: Vec<String>,
    /// The tracer's links left alone, and why.
    pub(crate) skipped: Vec<String>,
    /// Links that stay on throughout (`floor_second`'s first copy).
    _base: Vec<OwnedFd>,
    /// The empty cgroup the `CgroupIngress` links go to.
    empty: Option<BenchCgroup>,
}

/// The empty cgroup of the `programs` setups' segment program.
const EMPTY_CGROUP: &str = "ttft-bench-empty";

impl Hooks {
    /// Makes every link; closing them all undoes it.
    pub(crate) fn attach(&self) -> Result<Vec<OwnedFd>> {
        self.links
            .iter()
            .map(|(p, target)| {
                let prog = &self.progs[*p].1;
                match target {
                    Target::Tracepoint(tp) => rawfloor::raw_tp_open(prog, tp.as_deref()),
                    Target::CgroupIngress => {
                        let cgroup = self.empty.as_ref().context("no empty cgroup")?;
                        cgroup2::link(prog, cgroup.file(), BPF_CGROUP_INET_INGRESS)
                    }
                }
            })
            .collect()
    }

    /// The empty program, on each of the floor's tracepoints; with
    /// `second`, on top of a first link of it there that stays.
    pub(crate) fn floor(second: bool) -> Result<Self> {
        let mut hooks = Self::default();
        hooks.progs.push((rawfloor::NAME.into(), rawfloor::load()?));
        for tp in rawfloor::TRACEPOINTS {
            hooks
                .links
                .push((0, Target::Tracepoint(Some(CString::new(*tp)?))));
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
        for (name, fd, target) in tracerprogs::load(root, set)? {
            let at = match &target {
                Target::Tracepoint(Some(tp)) => tp.to_string_lossy().into_owned(),
                Target::Tracepoint(None) => "its BTF tracepoint".into(),
                Target::CgroupIngress => {
                    let empty = BenchCgroup::new(EMPTY_CGROUP)?;
                    let at = format!("the ingress of empty cgroup {}", empty.path());
                    hooks.empty = Some(empty);
                    at
                }
            };
            hooks.labels.push(format!("{name}@{at}"));
            hooks.progs.push((name, fd));
            hooks.links.push((hooks.progs.len() - 1, target));
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
                    hooks.links.push((p, Target::Tracepoint(tp)));
                }
                BPF_LINK_TYPE_CGROUP => hooks.skipped.push(format!(
                    "link {id}, the segment program on the workload's cgroup: it runs for that \
                     cgroup's sockets only (what it costs other tasks, the kernel's check of \
                     their own cgroup, is the programs setup's)"
                )),
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
