//! The items of `ttft-trace check`, read from this host.

use std::path::{Path, PathBuf};

use super::{CheckConfig, Item, Report, features_missing, parse_release, tracefs_mounts};
use crate::host::caps::{self, CAP_SYS_ADMIN, CAP_SYS_RESOURCE, CapSet};
use crate::host::tracefs::{self, Format};
use crate::probes::{self, EventHook, LoadConfig, Probes, SegmentHook, SendHook, TRACEPOINTS};

const UNIT_HINT: &str = "as a service: deploy/systemd/ttft-trace.service";

/// Runs every check. Loading the programs and the uprobe self-test are real:
/// they load into this kernel and detach before returning.
pub fn run(cfg: &CheckConfig) -> Report {
    let caps = CapSet::effective().unwrap_or_default();
    let release = kernel_release();
    let version = release.as_deref().and_then(parse_release);
    let mut items = vec![kernel(release.as_deref(), version), btf()];
    let (tracefs_item, root) = tracefs_item(caps);
    items.push(tracefs_item);
    items.push(uprobe_support(root.as_deref()));
    items.extend(tracepoints(root.as_deref()));
    items.extend(capabilities(caps));
    items.push(memlock(version, caps));
    items.push(sysctls());
    items.extend(load_and_fire(root.is_some()));
    items.push(nvml(cfg));
    Report { items }
}

fn kernel_release() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .ok()
        .map(|s| s.trim().to_string())
}

fn kernel(release: Option<&str>, version: Option<(u32, u32, u32)>) -> Item {
    let (Some(release), Some(version)) = (release, version) else {
        return Item::warn(
            "kernel",
            "cannot read the kernel release (/proc/sys/kernel/osrelease)",
            "none needed if the items below pass",
        );
    };
    let missing = features_missing(version);
    if missing.is_empty() {
        Item::ok(
            "kernel",
            format!(
                "{release} (5.8+ for the ring buffer and CAP_BPF, 6.3+ for the sock tracepoints)"
            ),
        )
    } else {
        Item::warn(
            "kernel",
            format!("{release} predates: {}", missing.join("; ")),
            "Linux 6.3 or later (a distribution kernel may have these backported: the \
             tracepoint and load items below decide)",
        )
    }
}

fn btf() -> Item {
    let path = Path::new("/sys/kernel/btf/vmlinux");
    if path.is_file() {
        Item::ok(
            "btf",
            "/sys/kernel/btf/vmlinux present (gives the send hook its struct offsets)",
        )
    } else {
        Item::warn(
            "btf",
            "no /sys/kernel/btf/vmlinux: the send hook falls back to syscall tracepoints (see \
             the send hook item)",
            "a kernel built with CONFIG_DEBUG_INFO_BTF=y",
        )
    }
}

fn tracefs_item(caps: CapSet) -> (Item, Option<PathBuf>) {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mounted = tracefs_mounts(&mounts);
    let fix_read =
        "run as root, or grant CAP_DAC_READ_SEARCH (tracefs is mode 0700, owned by root)";
    if let Some(dir) = mounted.first() {
        if dir.join("events").is_dir() {
            return (
                Item::ok("tracefs", format!("mounted at {}", dir.display())),
                Some(dir.clone()),
            );
        }
        return (
            Item::fail(
                "tracefs",
                format!(
                    "mounted at {}, but not readable by this process",
                    dir.display()
                ),
                fix_read,
            ),
            None,
        );
    }
    // Not mounted: ttft-trace mounts it itself, which takes CAP_SYS_ADMIN.
    match tracefs::root() {
        Ok(dir) => (
            Item::ok(
                "tracefs",
                format!(
                    "was not mounted; mounted it at {} (as ttft-trace does)",
                    dir.display()
                ),
            ),
            Some(dir),
        ),
        Err(e) => {
            let why = if caps.has(CAP_SYS_ADMIN) {
                e.to_string()
            } else {
                format!("not mounted, and mounting it needs {CAP_SYS_ADMIN}")
            };
            (
                Item::fail(
                    "tracefs",
                    why,
                    "mount it before starting: `mount -t tracefs nodev /sys/kernel/tracing` \
                     (systemd: sys-kernel-tracing.mount), or grant CAP_SYS_ADMIN",
                ),
                None,
            )
        }
    }
}

fn uprobe_support(root: Option<&Path>) -> Item {
    let pmu = Path::new("/sys/bus/event_source/devices/uprobe/type").is_file();
    let events = root.is_some_and(|r| r.join("uprobe_events").exists());
    match (pmu, events) {
        (true, _) => Item::ok(
            "uprobes",
            format!(
                "uprobe perf PMU present (CONFIG_UPROBES){}",
                if events {
                    ", uprobe_events in tracefs"
                } else {
                    ""
                }
            ),
        ),
        (false, true) => Item::fail(
            "uprobes",
            "no uprobe perf PMU (/sys/bus/event_source/devices/uprobe); only tracefs uprobe_events, \
             which this build does not use",
            "Linux 4.17 or later with CONFIG_UPROBES=y",
        ),
        (false, false) => Item::fail(
            "uprobes",
            "no uprobe support (no /sys/bus/event_source/devices/uprobe)",
            "a kernel with CONFIG_UPROBES=y and CONFIG_UPROBE_EVENTS=y",
        ),
    }
}

/// One item per tracepoint the probes attach to, then one for the fields read.
fn tracepoints(root: Option<&Path>) -> Vec<Item> {
    let Some(root) = root else {
        return vec![Item::fail(
            "tracepoints",
            "not checked: tracefs is not readable",
            "fix tracefs first",
        )];
    };
    let mut items: Vec<Item> = TRACEPOINTS
        .iter()
        .map(|&(_, category, name)| {
            let label = format!("tracepoint {category}:{name}");
            match Format::read(root, category, name) {
                Ok(_) => Item::ok(label, "present"),
                Err(e) => Item::fail(
                    label,
                    e.to_string(),
                    match category {
                        "sock" => "Linux 6.3 or later (sock_send_length/sock_recv_length)",
                        "syscalls" => "a kernel with CONFIG_FTRACE_SYSCALLS=y",
                        _ => "a kernel with this tracepoint (CONFIG_TRACEPOINTS=y)",
                    },
                ),
            }
        })
        .collect();
    items.push(ack_timing_item());
    items.push(match probes::tracepoint_offsets() {
        Ok(mut offsets) => match send_hook_planned(root, &mut offsets) {
            Ok(()) => Item::ok(
                "tracepoint fields",
                "every field the probes read is in its format file",
            ),
            Err(e) => Item::fail(
                "tracepoint fields",
                e,
                "a kernel with CONFIG_FTRACE_SYSCALLS=y, or with BTF and tcp:tcp_sendmsg_locked \
                 and tcp:tcp_rcv_space_adjust",
            ),
        },
        Err(e) => Item::fail(
            "tracepoint fields",
            e.to_string(),
            "a kernel whose tracepoints have these fields (report it: the layout changed)",
        ),
    });
    items
}

/// Whether `tcp_probe` can read what each segment acknowledged, which
/// decides whether a first token acknowledged just before the server's
/// close gets a delivery time.
fn ack_timing_item() -> Item {
    let plan = probes::tracepoint_offsets()
        .map_err(|e| e.to_string())
        .and_then(|offsets| probes::StructOffsets::read(&offsets).ack_seq);
    match plan {
        Ok(_) => Item::ok(
            "ACK timing",
            "each client segment's own acknowledgment number (tcp_probe skbaddr + BTF)",
        ),
        Err(why) => Item::warn(
            "ACK timing",
            format!(
                "at the next segment ({why}): a first token acknowledged by the last segment \
                 before the server's close gets no client estimate"
            ),
            "Linux with skbaddr in tcp:tcp_probe and BTF (CONFIG_DEBUG_INFO_BTF=y)",
        ),
    }
}

/// Checks what the planned send hook reads: the kernel's BTF and the raw
/// tracepoint, or the syscall tracepoints' fields for the fallback.
fn send_hook_planned(
    root: &Path,
    offsets: &mut ttft_trace_common::TracepointOffsets,
) -> Result<(), String> {
    let has_tracepoint = Format::read(root, "tcp", "tcp_sendmsg_locked").is_ok()
        && Format::read(root, "tcp", "tcp_rcv_space_adjust").is_ok();
    match probes::send_hook_plan() {
        Ok(_) if has_tracepoint => Ok(()),
        _ => probes::syscall_offsets(offsets).map_err(|e| e.to_string()),
    }
}

/// The send hook this host gets, and what it costs everything else.
fn send_hook_item(hook: SendHook) -> Item {
    match hook {
        SendHook::Tcp => Item::ok(
            "send hook",
            format!(
                "{}: the syscalls and UNIX-socket calls of processes not traced pay \
                 nothing; their TCP sends and receives run a program that returns after an \
                 array read, and their context switches the sched programs (see the event hook)",
                hook.describe()
            ),
        ),
        SendHook::Syscalls => {
            let why = match probes::send_hook_plan() {
                Err(why) => format!(" ({why})"),
                Ok(_) => {
                    " (attaching tcp:tcp_sendmsg_locked or tcp_rcv_space_adjust failed)".into()
                }
            };
            Item::warn(
                "send hook",
                format!(
                    "{}{why}: about +0.5 µs per syscall for every task on the host while tracing",
                    hook.describe()
                ),
                "a kernel with BTF (CONFIG_DEBUG_INFO_BTF=y) and the tcp:tcp_sendmsg_locked \
                 tracepoint (Linux 6.2+); unset TTFT_TRACE_SEND_HOOK",
            )
        }
    }
}

fn capabilities(caps: CapSet) -> Vec<Item> {
    caps::all_needs()
        .into_iter()
        .map(|need| {
            let label = format!("capability {}", need.caps_text());
            if need.met(caps) {
                Item::ok(label, format!("present: {}", need.why))
            } else if need.always {
                Item::fail(
                    label,
                    format!("missing: needed to {}", need.why),
                    format!("run as root, or grant {} ({UNIT_HINT})", need.any_of[0]),
                )
            } else {
                Item::warn(
                    label,
                    format!("missing: needed to {}", need.why),
                    format!(
                        "grant {} to trace such processes ({UNIT_HINT})",
                        need.any_of[0]
                    ),
                )
            }
        })
        .collect()
}

fn memlock(version: Option<(u32, u32, u32)>, caps: CapSet) -> Item {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass.
    let limit = if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } == 0 {
        if lim.rlim_cur == libc::RLIM_INFINITY {
            "unlimited".to_string()
        } else {
            format!("{} KiB", lim.rlim_cur / 1024)
        }
    } else {
        "unknown".to_string()
    };
    let charged_to_memcg = version.is_some_and(|v| (v.0, v.1) >= (5, 11));
    if charged_to_memcg || lim.rlim_cur == libc::RLIM_INFINITY || caps.has(CAP_SYS_RESOURCE) {
        Item::ok(
            "memlock",
            format!(
                "RLIMIT_MEMLOCK {limit}; {}",
                if charged_to_memcg {
                    "not used: since Linux 5.11 BPF memory is charged to the memory cgroup"
                } else {
                    "enough"
                }
            ),
        )
    } else {
        Item::warn(
            "memlock",
            format!("RLIMIT_MEMLOCK {limit} bounds BPF maps before Linux 5.11"),
            "`ulimit -l unlimited` (systemd: LimitMEMLOCK=infinity), or grant CAP_SYS_RESOURCE",
        )
    }
}

fn sysctls() -> Item {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "?".into())
    };
    Item::ok(
        "sysctls",
        format!(
            "kernel.perf_event_paranoid={}, kernel.unprivileged_bpf_disabled={}: they restrict \
             processes without CAP_PERFMON/CAP_BPF, so they do not apply",
            read("/proc/sys/kernel/perf_event_paranoid"),
            read("/proc/sys/kernel/unprivileged_bpf_disabled")
        ),
    )
}

/// Loads every program (the verifier's verdict), attaches the tracepoints,
/// then a uprobe on this binary that must fire once.
fn load_and_fire(tracefs_ok: bool) -> Vec<Item> {
    if !tracefs_ok {
        return vec![Item::fail(
            "ebpf load",
            "not tried: tracefs is not readable",
            "fix tracefs first",
        )];
    }
    let cfg = LoadConfig {
        ringbuf_bytes: 1 << 16,
        sched_min_ns: 1_000_000,
        large_copy_bytes: 1 << 20,
        discover: false,
        map_entries: Vec::new(),
        sched_programs: true,
    };
    let mut probes = match Probes::load(&cfg) {
        Ok(p) => p,
        Err(e) => {
            return vec![
                Item::fail(
                    "ebpf load",
                    e.to_string(),
                    "see the capability items above; a verifier error is a bug to report",
                ),
                Item::fail(
                    "uprobe self-test",
                    "not tried: loading failed",
                    "fix loading first",
                ),
            ];
        }
    };
    let (programs, tracepoints) = probes.loaded();
    let load = Item::ok(
        "ebpf load",
        format!("{programs} programs accepted by the verifier, {tracepoints} tracepoints attached"),
    );
    let hook = send_hook_item(probes.send_hook());
    let events = event_hook_item(probes.event_hook());
    let segments = segment_hook_item(&probes.segment_hook());
    let fire = match probes.uprobe_selftest() {
        Ok(1) => Item::ok(
            "uprobe self-test",
            "a uprobe on a function of this binary fired once",
        ),
        Ok(n) => Item::fail(
            "uprobe self-test",
            format!("the uprobe attached, but counted {n} calls instead of 1"),
            "report it (kernel and ttft-trace versions)",
        ),
        Err(e) => Item::fail(
            "uprobe self-test",
            e.to_string(),
            format!("run as root, or grant {CAP_SYS_ADMIN} ({UNIT_HINT})"),
        ),
    };
    vec![load, hook, events, segments, sched_source_item(), fire]
}

/// The two scheduler sources and what each costs the host; whether this
/// kernel shows the counters the sampled one reads.
fn sched_source_item() -> Item {
    let own = crate::schedstat::own_file();
    let readable = crate::schedstat::readable();
    let text = "--sched sampled (default): no program on any context switch, the traced \
                threads' /proc schedstat read every --sched-sample-ms; --sched exact: every \
                context switch on the host runs the switch program (about one BPF dispatch \
                each, the README's cost table)";
    if readable {
        Item::ok(
            "scheduler source",
            format!("{text} (readable on this kernel)"),
        )
    } else {
        Item::warn(
            "scheduler source",
            format!("{text}: {own} does not read here, so the tracer falls back to --sched exact"),
            "a kernel with CONFIG_SCHED_INFO (CONFIG_SCHEDSTATS or CONFIG_TASK_DELAY_ACCT), or \
             --sched exact",
        )
    }
}

/// How the per-event programs are attached, and what that costs tasks the
/// tracer does not follow.
fn event_hook_item(hook: EventHook) -> Item {
    match hook {
        EventHook::Raw => Item::ok(
            "event hook",
            format!(
                "{}: a context switch or wakeup of untraced tasks runs a program that \
                 returns after an array read per task, with no hash lookup (the README's cost \
                 table)",
                hook.describe()
            ),
        ),
        EventHook::Tracepoints => {
            let why = match probes::event_hook_plan() {
                Err(why) => format!(" ({why})"),
                Ok(_) => " (attaching the raw tracepoints failed)".into(),
            };
            Item::warn(
                "event hook",
                format!(
                    "{}{why}: every context switch and socket call on the host pays for it",
                    hook.describe()
                ),
                "a kernel with BTF (CONFIG_DEBUG_INFO_BTF=y), Linux 6.3+; unset \
                 TTFT_TRACE_EVENT_HOOK",
            )
        }
    }
}

/// How TCP segments are seen, and what that costs connections the tracer
/// does not follow.
fn segment_hook_item(hook: &SegmentHook) -> Item {
    const RAW: &str = "raw tracepoint tcp:tcp_probe: every TCP segment on the host runs a \
                       program; for a connection not followed it returns after a read of its \
                       local port and one array load (one hash lookup more where that port is \
                       a followed listening port)";
    match hook {
        SegmentHook::Cgroups(_) => {
            return Item::ok(
                "segment hook",
                "cgroup_skb ingress on the traced workloads' cgroups and their listening \
                 sockets' cgroups: segments of processes outside them run no program (the \
                 kernel's cgroup check only); host-wide on tcp:tcp_probe where a workload or its \
                 listener is in the root cgroup, with --port, or when the self-check finds \
                 followed connections whose segments it does not see",
            );
        }
        SegmentHook::Raw(why) if why.starts_with(probes::SEGMENT_HOOK_ENV) => {
            return Item::ok("segment hook", format!("{RAW} ({why})"));
        }
        SegmentHook::Raw(why) => {
            return Item::warn(
                "segment hook",
                format!("{RAW} (not on cgroups: {why})"),
                "a kernel with cgroup v2 mounted (cgroup_skb programs)",
            );
        }
        SegmentHook::Classic => {}
    }
    let why = match probes::segment_plan() {
        Err(why) => format!(" ({why})"),
        Ok(_) => " (attaching the raw tracepoint failed)".into(),
    };
    Item::warn(
        "segment hook",
        format!(
            "classic tracepoint tcp:tcp_probe{why}: the kernel fills a perf record of every TCP \
             segment on the host before the program runs"
        ),
        "a kernel with BTF (CONFIG_DEBUG_INFO_BTF=y); unset TTFT_TRACE_EVENT_HOOK",
    )
}

fn nvml(cfg: &CheckConfig) -> Item {
    match crate::nvml::probe(cfg.nvml_lib.as_deref()) {
        Ok((library, gpus)) => {
            let list: Vec<String> = gpus
                .iter()
                .map(|g| format!("{} {} ({})", g.index, g.name, g.uuid))
                .collect();
            Item::ok("nvml", format!("{library}: {}", list.join(", ")))
        }
        Err(reason) => Item::warn(
            "nvml",
            format!("{reason}; GPU readings will be off, everything else works"),
            "install the NVIDIA driver (libnvidia-ml.so.1), or pass --nvml-lib PATH; the \
             service needs read-write access to /dev/nvidia*",
        ),
    }
}
