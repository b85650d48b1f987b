//! The host-tax bench's setups: what each one runs while the untraced
//! operations are measured (the tracer as shipped and its fallbacks,
//! empty programs as the floor), how it starts and stops, and the busy
//! workload the tracer follows.

use std::{
    path::Path,
    process::{Child, Command, Stdio},
    thread,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};

use crate::{
    cgroup2::BenchCgroup,
    demo::{interrupt, start_tracer},
    rawfloor,
};

/// What one setup needs running while it is measured.
pub(crate) struct Setup {
    pub(crate) name: &'static str,
    pub(crate) what: &'static str,
}

pub(crate) fn setups(bpftrace: bool) -> Vec<Setup> {
    let mut v = vec![
        Setup {
            name: "attach_syscall_hook",
            what: "ttft-trace attach --pid WORKLOAD, TTFT_TRACE_SEND_HOOK=syscalls (the fallback; \
                   the default before)",
        },
        Setup {
            name: "attach_classic_events",
            what: "ttft-trace attach --pid WORKLOAD, TTFT_TRACE_EVENT_HOOK=tracepoints (the \
                   fallback; the default before)",
        },
        Setup {
            name: "attach",
            what: "ttft-trace attach --pid WORKLOAD",
        },
        Setup {
            name: "daemon",
            what: "ttft-trace daemon (finds WORKLOAD itself)",
        },
        Setup {
            name: "attach_exact_sched",
            what: "ttft-trace attach --pid WORKLOAD --sched exact (a program on every context \
                   switch of the host; opt-in)",
        },
        Setup {
            name: "daemon_exact_sched",
            what: "ttft-trace daemon --sched exact (finds WORKLOAD itself; a program on every \
                   context switch)",
        },
    ];
    v.push(Setup {
        name: "empty_raw_programs",
        what: "empty programs on the raw tracepoints sched_switch, tcp_probe, \
               tcp_sendmsg_locked, tcp_rcv_space_adjust (the floor of the default path)",
    });
    if bpftrace {
        v.push(Setup {
            name: "empty_tracepoints",
            what: "bpftrace, empty programs on sched_switch, sched_wakeup, sched_wakeup_new, \
                   tcp_probe (the floor of the classic tracepoints)",
        });
    }
    v
}

/// A setup while it is measured.
pub(crate) enum Running {
    /// A tracer, or bpftrace (`bpftrace`), stopped with SIGINT after.
    Process { child: Child, bpftrace: bool },
    /// Empty programs this process holds.
    Floor(rawfloor::Floor),
}

/// Starts what `setup` needs.
pub(crate) fn start(root: &Path, setup: &str, workload: u32) -> Result<Running> {
    match setup {
        "empty_raw_programs" => Ok(Running::Floor(rawfloor::attach()?)),
        "empty_tracepoints" => Ok(Running::Process {
            child: start_bpftrace(
                "tracepoint:sched:sched_switch {} tracepoint:sched:sched_wakeup {} \
                 tracepoint:sched:sched_wakeup_new {} tracepoint:tcp:tcp_probe {}",
            )?,
            bpftrace: true,
        }),
        tracer => Ok(Running::Process {
            child: start_ttft_trace(root, tracer, workload)?,
            bpftrace: false,
        }),
    }
}

/// Starts the tracer as `setup` runs it.
fn start_ttft_trace(root: &Path, setup: &str, workload: u32) -> Result<Child> {
    let attach_args = vec![
        "--pid".to_string(),
        workload.to_string(),
        "--no-listen".into(),
        "--interval".into(),
        "3600".into(),
    ];
    let daemon_args: Vec<String> = vec![
        "--listen=".into(),
        "--no-nvml".into(),
        "--interval".into(),
        "3600".into(),
    ];
    // `--sched MODE`, whichever the default is (the toggle bench shows
    // both sources side by side).
    let sched = |args: &[String], mode: &str| {
        let mut args = args.to_vec();
        args.extend(["--sched".into(), mode.into()]);
        args
    };
    let forced = |var: &str, value: &str| {
        // SAFETY: xtask is single-threaded here; the variable is set only
        // for the tracer started next and removed right after.
        unsafe { std::env::set_var(var, value) };
        let child = start_tracer(root, "attach", &attach_args, "attached");
        // SAFETY: as above.
        unsafe { std::env::remove_var(var) };
        child
    };
    match setup {
        "attach_syscall_hook" => forced("TTFT_TRACE_SEND_HOOK", "syscalls"),
        "attach_classic_events" => forced("TTFT_TRACE_EVENT_HOOK", "tracepoints"),
        "attach" => start_tracer(root, "attach", &attach_args, "attached"),
        "daemon" => start_tracer(root, "daemon", &daemon_args, "attached"),
        "attach_exact_sched" => {
            start_tracer(root, "attach", &sched(&attach_args, "exact"), "attached")
        }
        "daemon_exact_sched" => {
            start_tracer(root, "daemon", &sched(&daemon_args, "exact"), "attached")
        }
        other => bail!("unknown setup {other}"),
    }
}

/// Starts bpftrace on `program` and returns once its probes are live (it
/// prints "Attaching N probes..." then).
pub fn start_bpftrace(program: &str) -> Result<Child> {
    let mut child = Command::new("bpftrace")
        .args(["-e", program])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting bpftrace (cargo xtask setup installs it)")?;
    let mut line = String::new();
    let stdout = child.stdout.take().context("bpftrace stdout")?;
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)?;
    thread::sleep(Duration::from_millis(200));
    Ok(child)
}

/// Stops a setup, and waits until the kernel has removed its uprobes (its
/// `ttft-detach` child is gone): removing a uprobe holds up every fork on
/// the host (the kernel's `dup_mmap_sem`), which the next rows would pay.
pub(crate) fn stop(running: Running) -> Result<()> {
    match running {
        Running::Process {
            mut child,
            bpftrace,
        } => {
            interrupt(&mut child, bpftrace, Duration::from_secs(60))?;
            crate::attachtime::wait_for_detaches()
        }
        Running::Floor(floor) => {
            drop(floor);
            Ok(())
        }
    }
}

/// The busy traced workload's cgroup: where a container's or a systemd
/// unit's processes would be, so that the tracer's segment program goes on
/// it, not host-wide (the measured operations run in this process's).
pub(crate) const WORKLOAD_CGROUP: &str = "ttft-bench-workload";

/// The busy traced workload, in a cgroup of its own.
pub(crate) struct Workload {
    child: Child,
    cgroup: Option<BenchCgroup>,
}

impl Workload {
    pub(crate) fn id(&self) -> u32 {
        self.child.id()
    }

    /// Kills it and removes its cgroup.
    pub(crate) fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        drop(self.cgroup.take());
    }
}

/// The busy traced workload: the stub runtime launching in a loop, with
/// short sleeps between episodes (so its threads switch too), moved into
/// [`WORKLOAD_CGROUP`] at once (it opens no socket, and the tracer reads
/// its cgroup later). Without a cgroup v2 hierarchy it stays here, and the
/// tracer's segment program is host-wide.
pub(crate) fn start_workload(root: &Path) -> Result<Workload> {
    let child = Command::new(root.join("target/fixtures/workload"))
        .args([
            "--style",
            "sync",
            "--episodes",
            "100000000",
            "--launches",
            "4",
            "--kernel-us",
            "200",
            "--gap-us",
            "500",
        ])
        .stdout(Stdio::null())
        .spawn()
        .context("starting the workload fixture")?;
    let mut workload = Workload {
        child,
        cgroup: None,
    };
    match crate::cgroup2::root()? {
        Some(_) => {
            let cgroup = BenchCgroup::new(WORKLOAD_CGROUP)?;
            cgroup.add(workload.id())?;
            workload.cgroup = Some(cgroup);
        }
        None => eprintln!(
            "bench: no cgroup v2 hierarchy: the workload shares the bench's cgroup, and the \
             tracer's segment program is host-wide"
        ),
    }
    Ok(workload)
}
