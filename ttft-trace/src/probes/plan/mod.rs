//! Step two of loading, deciding: from a kernel description and the
//! settings alone, which hook serves each job and why, and the values of
//! the loader's globals. Pure (nothing is read, nothing loaded), so that it
//! is tested on recorded kernels; `super::load` carries it out, and where
//! the kernel refuses an attach that no description foresees, takes the
//! fallback the plan allows and amends the plan's hooks to say so. The
//! start log's lines and `check`'s items about hooks come from the hooks.
//!
//! The three ladders: sends on the raw TCP tracepoints, else the syscall
//! tracepoints; the per-event programs on BTF and raw tracepoints, else the
//! classic ones; segments on the workloads' cgroups, else the raw
//! `tcp_probe` host-wide, else the classic one.

mod lines;
mod offsets;
mod overrides;
#[cfg(test)]
mod tests;

pub use overrides::Overrides;

use std::path::PathBuf;

use thiserror::Error;
use ttft_trace_common::{
    SendOffsets, TracepointOffsets,
    offsets::{ABSENT, SegmentOffsets, TaskOffsets},
};

use super::{
    EVENT_HOOK_ENV, EventHook, LoadConfig, SEGMENT_HOOK_ENV, SEND_HOOK_ENV, SendHook,
    btf::{self, BtfFacts},
    kernel::KernelDescription,
};
use crate::host::tracefs::TracefsError;

#[derive(Debug, Error)]
pub enum PlanError {
    /// A tracepoint every hook uses is missing, or a field of it.
    #[error(transparent)]
    Tracepoints(TracefsError),
    /// The syscall send hook is the only one, and its fields are missing.
    #[error(transparent)]
    SyscallFields(TracefsError),
}

/// The hook that serves one job, and why it is not the default one (None
/// where it is).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice<H> {
    pub hook: H,
    pub why: Option<String>,
}

/// Where segments are seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SegmentChoice {
    /// `cgroup_skb` on the traced workloads' cgroups, below this cgroup v2
    /// mount (the raw `tcp_probe` host-wide where a workload has none).
    Cgroups(PathBuf),
    /// The raw `tcp_probe` host-wide, and why not on cgroups.
    Raw(String),
    /// The classic `tcp_probe`, and why not the raw one.
    Classic(String),
}

/// Each job's hook: as planned, and after loading as attached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hooks {
    pub send: Choice<SendHook>,
    pub event: Choice<EventHook>,
    pub segments: SegmentChoice,
}

/// What the loader writes into the object: globals and map sizes.
#[derive(Debug, Clone)]
pub struct Globals {
    pub offsets: TracepointOffsets,
    /// The default hooks' BTF offsets (zero where not read: unused then).
    pub send: SendOffsets,
    pub task: TaskOffsets,
    pub segment: SegmentOffsets,
    /// Wake the reader early only when an eighth of the buffer is used;
    /// otherwise it drains on its timer (see the probes' wakeup_flag).
    pub wakeup_bytes: u64,
    pub sched_min_ns: u64,
    pub large_copy_bytes: u64,
    pub discover: u32,
    pub ringbuf_bytes: u32,
    pub map_entries: Vec<(&'static str, u32)>,
}

/// What to load and attach, and why.
#[derive(Debug, Clone)]
pub struct Plan {
    pub hooks: Hooks,
    pub globals: Globals,
    /// The syscall send hook's fields were read: it can stand in where
    /// attaching the TCP one fails.
    pub syscalls_ready: bool,
    /// The BTF wakeup programs are needed: no `sched_info` to read wakeups
    /// from (or forced).
    pub wakeup_programs: bool,
    /// The scheduler programs are attached (not with `--sched sampled`).
    pub sched_programs: bool,
    /// Each segment's own acknowledgment number is read, or why not.
    pub ack_timing: Result<(), String>,
    /// A socket's network namespace is read, or why not.
    pub namespaces: Result<(), String>,
}

/// The BTF layouts of the default hooks, or why each cannot be had.
struct BtfLayouts {
    send: Result<SendOffsets, String>,
    task: Result<TaskOffsets, String>,
    segment: Result<SegmentOffsets, String>,
}

impl BtfLayouts {
    fn read(btf: Result<&BtfFacts, &String>, o: &Overrides) -> Self {
        let classic = o
            .classic_events
            .then(|| format!("{EVENT_HOOK_ENV}=tracepoints"));
        let sends = o.syscall_sends.then(|| format!("{SEND_HOOK_ENV}=syscalls"));
        let mut task = layout(btf, classic.clone(), btf::task_offsets);
        if let (Ok(task), true) = (&mut task, o.wakeup_programs) {
            (task.last_queued, task.last_arrival) = (ABSENT, ABSENT);
        }
        Self {
            send: layout(btf, sends, btf::send_offsets),
            task,
            segment: layout(btf, classic, btf::segment_offsets),
        }
    }
}

/// One layout, or why not: the switch that forces the fallback, no BTF, or
/// what BTF lacks.
fn layout<T>(
    btf: Result<&BtfFacts, &String>,
    forced: Option<String>,
    read: fn(&dyn btf::Layouts) -> Result<T, btf::BtfError>,
) -> Result<T, String> {
    if let Some(why) = forced {
        return Err(why);
    }
    read(btf.map_err(String::clone)?).map_err(|e| e.to_string())
}

impl Plan {
    /// Decides, from what `kernel` offers, the switches and the settings.
    pub fn new(
        kernel: &KernelDescription,
        overrides: &Overrides,
        cfg: &LoadConfig,
    ) -> Result<Self, PlanError> {
        let tracepoints = kernel
            .tracefs
            .as_ref()
            .map_err(|why| PlanError::Tracepoints(TracefsError::Recorded(why.clone())))?;
        let mut offsets =
            offsets::tracepoint_offsets(tracepoints).map_err(PlanError::Tracepoints)?;
        let btf = kernel.btf.as_ref();
        let ack_timing = offsets::ack_timing(btf, &mut offsets);
        let namespaces = offsets::namespaces(btf, &mut offsets);
        let layouts = BtfLayouts::read(btf, overrides);
        let syscalls_read = offsets::syscall_fields(tracepoints, &mut offsets);
        let syscalls_ready = syscalls_read.is_ok();
        let send = match &layouts.send {
            Ok(_) => Choice::default_hook(SendHook::Tcp),
            Err(why) => Choice::fallback(SendHook::Syscalls, why),
        };
        if let (SendHook::Syscalls, Err(e)) = (send.hook, syscalls_read) {
            return Err(PlanError::SyscallFields(e));
        }
        let event = match &layouts.task {
            Ok(_) => Choice::default_hook(EventHook::Raw),
            Err(why) => Choice::fallback(EventHook::Tracepoints, why),
        };
        let segments = segment_choice(kernel, overrides, &layouts, &event);
        Ok(Self {
            hooks: Hooks {
                send,
                event,
                segments,
            },
            globals: Globals::new(offsets, &layouts, cfg),
            syscalls_ready,
            wakeup_programs: layouts.task.is_ok_and(|t| !t.has_sched_info()),
            sched_programs: cfg.sched_programs,
            ack_timing,
            namespaces,
        })
    }
}

/// Segments on cgroups where the raw `tcp_probe` can back them up and the
/// v2 hierarchy is mounted; the raw one is attached with the event hook's
/// programs, so not without them.
fn segment_choice(
    kernel: &KernelDescription,
    overrides: &Overrides,
    layouts: &BtfLayouts,
    event: &Choice<EventHook>,
) -> SegmentChoice {
    if let Err(why) = &layouts.segment {
        return SegmentChoice::Classic(why.clone());
    }
    if let Some(why) = &event.why {
        return SegmentChoice::Classic(why.clone());
    }
    if overrides.host_wide_segments {
        return SegmentChoice::Raw(format!("{SEGMENT_HOOK_ENV}=tcp_probe"));
    }
    match &kernel.cgroup2 {
        Ok(mount) => SegmentChoice::Cgroups(mount.clone()),
        Err(why) => SegmentChoice::Raw(why.clone()),
    }
}

impl<H> Choice<H> {
    fn default_hook(hook: H) -> Self {
        Self { hook, why: None }
    }

    fn fallback(hook: H, why: &str) -> Self {
        Self {
            hook,
            why: Some(why.to_string()),
        }
    }
}

impl Globals {
    fn new(offsets: TracepointOffsets, layouts: &BtfLayouts, cfg: &LoadConfig) -> Self {
        Self {
            offsets,
            send: layouts.send.clone().unwrap_or_default(),
            task: layouts.task.clone().unwrap_or_default(),
            segment: layouts.segment.clone().unwrap_or_default(),
            wakeup_bytes: u64::from(cfg.ringbuf_bytes / 8),
            sched_min_ns: cfg.sched_min_ns,
            large_copy_bytes: cfg.large_copy_bytes,
            discover: u32::from(cfg.discover),
            ringbuf_bytes: cfg.ringbuf_bytes,
            map_entries: cfg.map_entries.clone(),
        }
    }
}

impl Hooks {
    /// Attaching the TCP send hook failed: the syscall one instead.
    pub fn sends_fell_back(&mut self, error: &str) {
        self.send = Choice::fallback(
            SendHook::Syscalls,
            &format!("attaching tcp:tcp_sendmsg_locked or tcp_rcv_space_adjust failed: {error}"),
        );
    }

    /// Attaching the BTF and raw tracepoints failed: the classic ones
    /// instead, for segments too.
    pub fn events_fell_back(&mut self, error: &str) {
        let why = format!("attaching the raw tracepoints failed: {error}");
        if !matches!(self.segments, SegmentChoice::Classic(_)) {
            self.segments = SegmentChoice::Classic(why.clone());
        }
        self.event = Choice::fallback(EventHook::Tracepoints, &why);
    }

    /// Loading the cgroup program failed: the raw tracepoint host-wide.
    pub fn cgroups_fell_back(&mut self, error: &str) {
        self.segments = SegmentChoice::Raw(error.to_string());
    }
}
