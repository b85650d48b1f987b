//! The items of `ttft-trace check`, read from this host.

use std::path::{Path, PathBuf};

use super::{
    CheckConfig, Item, Report, features_missing,
    hooks::{ack_timing_item, event_hook_item, fields_item, segment_hook_item, send_hook_item},
    parse_release, tracefs_mounts,
};
use crate::host::caps::{self, CAP_SYS_ADMIN, CAP_SYS_RESOURCE, CapSet};
use crate::host::tracefs;
use crate::probes::{
    KernelDescription, LoadConfig, Overrides, Plan, PlanError, Probes, TRACEPOINTS,
};

const UNIT_HINT: &str = "as a service: deploy/systemd/ttft-trace.service";

/// Runs every check. Loading the programs and the uprobe self-test are real:
/// they load into this kernel and detach before returning.
pub fn run(cfg: &CheckConfig) -> Report {
    let caps = CapSet::effective().unwrap_or_default();
    // tracefs first: reading the kernel mounts it where it is not, and the
    // tracefs item says whether it was.
    let (tracefs_item, root) = tracefs_item(caps);
    let kernel = KernelDescription::read();
    let load = load_config();
    let plan = Plan::new(&kernel, &Overrides::from_env(), &load);
    let release = kernel.release.as_deref();
    let version = release.and_then(parse_release);
    let mut items = vec![kernel_item(release, version), btf(&kernel)];
    items.push(tracefs_item);
    items.push(uprobe_support(root.as_deref()));
    items.extend(tracepoints(root.is_some(), &kernel, &plan));
    items.extend(capabilities(caps));
    items.push(memlock(version, caps));
    items.push(sysctls());
    items.extend(load_and_fire(root.is_some(), &load));
    items.push(nvml(cfg));
    if let Some(pid) = cfg.pid {
        items.extend(super::target::items(pid));
    }
    if let Some(shares) = &cfg.shares {
        items.extend(super::quotas::items(
            shares,
            &super::quotas::read_holdings(),
        ));
    }
    Report { items }
}

/// The settings `check` loads the probes with.
pub(super) fn load_config() -> LoadConfig {
    LoadConfig {
        ringbuf_bytes: 1 << 16,
        sched_min_ns: 1_000_000,
        large_copy_bytes: 1 << 20,
        discover: false,
        map_entries: Vec::new(),
        sched_programs: true,
    }
}

fn kernel_item(release: Option<&str>, version: Option<(u32, u32, u32)>) -> Item {
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

fn btf(kernel: &KernelDescription) -> Item {
    if kernel.btf.is_ok() {
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

/// One item per tracepoint the probes attach to, then the ACK timing and
/// the fields read, as the plan has them.
fn tracepoints(
    tracefs_ok: bool,
    kernel: &KernelDescription,
    plan: &Result<Plan, PlanError>,
) -> Vec<Item> {
    if !tracefs_ok {
        return vec![Item::fail(
            "tracepoints",
            "not checked: tracefs is not readable",
            "fix tracefs first",
        )];
    }
    let mut items: Vec<Item> = TRACEPOINTS
        .iter()
        .map(|&(_, category, name)| {
            let label = format!("tracepoint {category}:{name}");
            let format = match &kernel.tracefs {
                Ok(tracepoints) => tracepoints.format(category, name).map(drop),
                Err(why) => Err(tracefs::TracefsError::Recorded(why.clone())),
            };
            match format {
                Ok(()) => Item::ok(label, "present"),
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
    let ack_timing = match plan {
        Ok(plan) => plan.ack_timing.clone(),
        Err(e) => Err(e.to_string()),
    };
    items.push(ack_timing_item(ack_timing));
    items.push(fields_item(plan.as_ref().map(drop)));
    items
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
fn load_and_fire(tracefs_ok: bool, cfg: &LoadConfig) -> Vec<Item> {
    if !tracefs_ok {
        return vec![Item::fail(
            "ebpf load",
            "not tried: tracefs is not readable",
            "fix tracefs first",
        )];
    }
    let mut probes = match Probes::load(cfg) {
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
    let hook = send_hook_item(&probes.hooks().send);
    let events = event_hook_item(&probes.hooks().event);
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
                each, docs/costs.md)";
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
