//! Step three of loading, carrying out a plan: the object loaded with the
//! plan's globals, then each job's programs attached as the plan says.
//! Where the kernel refuses an attach that no description foresees, the
//! fallback the plan allows is taken and the plan's hooks amended to say
//! so; the log's lines about hooks come from the hooks.

use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, Instant},
};

use aya::{
    Ebpf, EbpfLoader,
    programs::{TracePoint, UProbe},
};

use super::{
    LoadConfig, OBJECT, ProbeError, Probes, TRACEPOINTS, byte_arrays, event_hook,
    is_scheduler_program,
    kernel::KernelDescription,
    plan::{Hooks, Overrides, Plan, SegmentChoice},
    segment_scope,
    send_hook::{SYSCALL_SEND_TRACEPOINTS, attach_tcp, is_socket_length, load_held_sends},
    symbols,
};
use crate::host::caps;

/// What attaching did: the hooks as attached, and the tracepoints.
struct Linked {
    hooks: Hooks,
    /// Tracepoints attached (classic, raw and BTF), for `check`.
    tracepoints: usize,
    /// The classic programs the BTF and raw ones stand in for.
    replaced: Vec<&'static str>,
}

impl Linked {
    /// Whether sends are reported by the classic `sock_send_length`.
    fn classic_sends(&self) -> bool {
        self.hooks.socket_lengths() && !self.replaced.contains(&"sock_send_length")
    }
}

impl Probes {
    /// Loads every program, attaches the process-tree tracepoints. Uprobes
    /// wait for [`Probes::attach_library`].
    pub fn load(cfg: &LoadConfig) -> Result<Self, ProbeError> {
        if OBJECT.is_empty() {
            return Err(ProbeError::NoObject);
        }
        can_load()?;
        let started = Instant::now();
        let kernel = KernelDescription::read();
        let plan = Plan::new(&kernel, &Overrides::from_env(), cfg)?;
        for line in plan.reasons() {
            log::info!("{line}");
        }
        let layouts = started.elapsed();
        let mut ebpf = load_object(&plan)?;
        let verified = started.elapsed();
        let linked = attach(&mut ebpf, &plan)?;
        log_times(started.elapsed(), layouts, verified);
        Self::loaded_as(ebpf, &plan, linked)
    }

    /// Loads the program a send that may carry a memory BIO's records is
    /// handed to, once, where the first traced process maps OpenSSL's
    /// `libcrypto`: a host with no such process never verifies it.
    pub fn want_held_sends(&mut self) {
        let Some(classic) = self.held_sends.take() else {
            return;
        };
        let started = Instant::now();
        match load_held_sends(&mut self.ebpf, classic) {
            Ok(()) => log::info!(
                "TLS records written to a memory BIO: bound to their sends (program verified \
                 in {:.0} ms)",
                started.elapsed().as_secs_f64() * 1e3
            ),
            Err(e) => log::warn!(
                "TLS records written to a memory BIO will not be bound to their sends: {e}"
            ),
        }
    }

    fn loaded_as(ebpf: Ebpf, plan: &Plan, linked: Linked) -> Result<Self, ProbeError> {
        let held_sends = Some(linked.classic_sends());
        let scope = segment_scope::Scope::new(match &linked.hooks.segments {
            SegmentChoice::Cgroups(mount) => Ok(mount.clone()),
            SegmentChoice::Raw(why) | SegmentChoice::Classic(why) => Err(why.clone()),
        });
        Ok(Self {
            traced_ids: byte_arrays::SharedBytes::map(&ebpf, byte_arrays::TRACED_IDS)?,
            listen_ports: byte_arrays::SharedBytes::map(&ebpf, byte_arrays::LISTEN_PORTS)?,
            ebpf,
            raw_segments: matches!(linked.hooks.segments, SegmentChoice::Raw(_)),
            hooks: linked.hooks,
            scope,
            tracepoints: linked.tracepoints,
            netns_known: plan.namespaces.is_ok(),
            held_sends,
            attached: HashMap::new(),
            map_full: BTreeMap::new(),
        })
    }
}

/// The capabilities loading takes, or which are missing.
fn can_load() -> Result<(), ProbeError> {
    let have = caps::CapSet::effective().unwrap_or_default();
    let missing = caps::missing(have, caps::LOAD);
    if missing.is_empty() {
        Ok(())
    } else {
        Err(ProbeError::Capabilities(caps::missing_message(
            have, &missing,
        )))
    }
}

/// Loads the object with the plan's globals and map sizes, and the uprobe
/// programs (attached later, per library).
fn load_object(plan: &Plan) -> Result<Ebpf, ProbeError> {
    let g = &plan.globals;
    let mut loader = EbpfLoader::new();
    loader
        .override_global("OFFSETS", &g.offsets, true)
        .override_global("SEND_OFFSETS", &g.send, true)
        .override_global("TASK_OFFSETS", &g.task, true)
        .override_global("SEGMENT_OFFSETS", &g.segment, true)
        .override_global("WAKEUP_BYTES", &g.wakeup_bytes, true)
        .override_global("SCHED_MIN_NS", &g.sched_min_ns, true)
        .override_global("LARGE_COPY_BYTES", &g.large_copy_bytes, true)
        .override_global("DISCOVER", &g.discover, true)
        .map_max_entries("EVENTS", g.ringbuf_bytes)
        .map_max_entries(byte_arrays::TRACED_IDS, byte_arrays::traced_id_slots());
    for &(map, entries) in &g.map_entries {
        loader.map_max_entries(map, entries);
    }
    let mut ebpf = loader.load(OBJECT).map_err(ProbeError::Load)?;
    for name in symbols::program_names() {
        let prog: &mut UProbe = ebpf
            .program_mut(name)
            .ok_or(ProbeError::Missing(name))?
            .try_into()
            .map_err(|e| ProbeError::Program(name, e))?;
        prog.load().map_err(|e| ProbeError::Program(name, e))?;
    }
    Ok(ebpf)
}

/// Attaches each job's programs: the send hook first (whether the socket
/// lengths are needed depends on it), the cgroup segment program loaded
/// (the raw `tcp_probe` is its fallback, so it waits for the event hook),
/// the event hook, then the classic tracepoints left.
fn attach(ebpf: &mut Ebpf, plan: &Plan) -> Result<Linked, ProbeError> {
    let mut linked = Linked {
        hooks: plan.hooks.clone(),
        tracepoints: 0,
        replaced: Vec::new(),
    };
    attach_sends(ebpf, plan, &mut linked)?;
    if matches!(linked.hooks.segments, SegmentChoice::Cgroups(_))
        && let Err(e) = segment_scope::load(ebpf)
    {
        linked.hooks.cgroups_fell_back(&e.to_string());
    }
    attach_events(ebpf, plan, &mut linked);
    log::info!("{}", linked.hooks.segments_line());
    attach_classic(ebpf, plan, &mut linked)?;
    log::info!("{}", linked.hooks.event_line(plan.sched_programs));
    if linked.hooks.socket_lengths() {
        for &(name, tracepoint) in SYSCALL_SEND_TRACEPOINTS {
            attach_tracepoint(ebpf, name, "syscalls", tracepoint)?;
            linked.tracepoints += 1;
        }
    }
    log::info!("{}", linked.hooks.send_line());
    Ok(linked)
}

/// The TCP send hook where planned, or the syscall one where it fails and
/// the plan has that one's fields.
fn attach_sends(ebpf: &mut Ebpf, plan: &Plan, linked: &mut Linked) -> Result<(), ProbeError> {
    if linked.hooks.socket_lengths() {
        return Ok(());
    }
    match attach_tcp(ebpf) {
        Ok(n) => linked.tracepoints += n,
        Err(e) if plan.syscalls_ready => {
            log::warn!("send hook: {e}; using the syscall tracepoints instead");
            linked.hooks.sends_fell_back(&e.to_string());
        }
        Err(e) => return Err(e),
    }
    Ok(())
}

/// The BTF and raw per-event programs where planned, or none (the classic
/// ones then) where attaching one fails.
fn attach_events(ebpf: &mut Ebpf, plan: &Plan, linked: &mut Linked) {
    if !linked.hooks.raw_events() {
        return;
    }
    let wanted = event_hook::Wanted {
        socket_lengths: linked.hooks.socket_lengths(),
        switches: plan.sched_programs,
        wakeups: plan.sched_programs && plan.wakeup_programs,
        segments: !matches!(linked.hooks.segments, SegmentChoice::Classic(_)),
        scoped_segments: matches!(linked.hooks.segments, SegmentChoice::Cgroups(_)),
    };
    match event_hook::attach_default(ebpf, &wanted) {
        Ok((attached, covered)) => {
            linked.tracepoints += attached;
            linked.replaced = covered;
            log::info!("{}", plan.wakeups_line());
        }
        Err(e) => {
            log::warn!("event hook: {e}; using the classic tracepoints instead");
            linked.hooks.events_fell_back(&e.to_string());
        }
    }
}

/// The classic tracepoints nothing else stands in for: the socket lengths
/// with the syscall send hook only, the scheduler's unless `--sched
/// sampled`.
fn attach_classic(ebpf: &mut Ebpf, plan: &Plan, linked: &mut Linked) -> Result<(), ProbeError> {
    for &(name, category, tracepoint) in TRACEPOINTS {
        if linked.replaced.contains(&name)
            || (!linked.hooks.socket_lengths() && is_socket_length(name))
            || (!plan.sched_programs && is_scheduler_program(name))
        {
            continue;
        }
        attach_tracepoint(ebpf, name, category, tracepoint)?;
        linked.tracepoints += 1;
    }
    Ok(())
}

fn log_times(total: Duration, layouts: Duration, verified: Duration) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    log::info!(
        "probes loaded in {:.0} ms: kernel layouts (tracefs, BTF) {:.0} ms, maps and \
         programs loaded and verified {:.0} ms, tracepoint links {:.0} ms",
        ms(total),
        ms(layouts),
        ms(verified - layouts),
        ms(total - verified)
    );
}

/// Loads a tracepoint program (once: several tracepoints may share one)
/// and attaches it.
fn attach_tracepoint(
    ebpf: &mut Ebpf,
    name: &'static str,
    category: &str,
    tracepoint: &str,
) -> Result<(), ProbeError> {
    let prog: &mut TracePoint = ebpf
        .program_mut(name)
        .ok_or(ProbeError::Missing(name))?
        .try_into()
        .map_err(|e| ProbeError::Program(name, e))?;
    if prog.fd().is_err() {
        prog.load().map_err(|e| ProbeError::Program(name, e))?;
    }
    prog.attach(category, tracepoint)
        .map_err(|e| ProbeError::Program(name, e))?;
    Ok(())
}
