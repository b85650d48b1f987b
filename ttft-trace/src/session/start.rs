//! Starting a session in either mode: the sinks and /metrics, the probes,
//! NVML, then what the mode traces first.

use std::{net::TcpListener, time::Instant};

use anyhow::{Result, bail};

use super::{LARGE_COPY_BYTES, Sampling, Session, Signals, Stop};
use crate::{
    config::{AttachConfig, DaemonOptions, SchedSignals, TraceConfig},
    export::{Sinks, prometheus},
    host::targets,
    judging::Judge,
    nvml::{self, Sampler},
    probes::{LoadConfig, Probes},
    requests::CorrelatorConfig,
    routing::Router,
    schedstat::{self, SchedSampler},
    tracking::{Discovery, Mode, Tracking, WaitFor},
};

/// `ttft-trace attach --pid PID`: one workload, the target's process tree.
pub async fn attach(cfg: AttachConfig) -> Result<Stop> {
    if !targets::is_process(cfg.pid) {
        bail!(
            "no process with pid {} (or it is a thread, or a zombie)",
            cfg.pid
        );
    }
    let title = format!(
        "pid {} ({})",
        cfg.pid,
        targets::comm(cfg.pid).unwrap_or_default()
    );
    let (mut s, listener) = Session::start(
        &cfg.trace,
        Mode::Attach {
            host_wide_probes: cfg.host_wide_probes,
        },
    )?;
    s.tracking.add_workload(cfg.pid)?;
    s.tracking.attach_named(&cfg.cuda_libs)?;
    s.tracking.rescan()?;
    // Ports first: with --wait, the first request may be what makes the
    // server load its CUDA library (a lazily started engine process).
    s.tracking.follow_ports(&cfg.trace.ports)?;
    s.tracking
        .wait_for_library(&WaitFor {
            pid: cfg.pid,
            wait: cfg.wait,
            timeout: cfg.wait_timeout,
        })
        .await?;
    s.apply_changes();
    s.run_to_end(listener, &cfg.trace, &title).await
}

/// `ttft-trace daemon`: every inference workload on the host.
pub async fn daemon(opts: DaemonOptions) -> Result<Stop> {
    let discovery = Discovery::new(opts.filters, opts.rescan, opts.detach_unmapped);
    let (mut s, listener) = Session::start(&opts.trace, Mode::Daemon(discovery))?;
    s.tracking.attach_named(&opts.cuda_libs)?;
    s.tracking.discover()?;
    s.tracking.follow_ports(&opts.trace.ports)?;
    s.apply_changes();
    let scans = opts.rescan.map_or_else(
        || "no periodic /proc scan (rescan_ms = 0)".to_string(),
        |p| format!("scanning /proc every {p:?}"),
    );
    log::info!(
        "daemon: {} workload(s) at start; {scans}",
        s.tracking.workloads()
    );
    s.run_to_end(listener, &opts.trace, "daemon").await
}

impl Session {
    /// Binds /metrics (first, so a port in use fails before anything is
    /// loaded), loads the probes, opens the JSONL file, starts NVML.
    fn start(cfg: &TraceConfig, mode: Mode) -> Result<(Self, Option<TcpListener>)> {
        let signals = Signals::install()?;
        let sched = sched_source(cfg.sched);
        let mut sinks = Sinks::new(&cfg.labels)?;
        let listener = cfg.listen.map(prometheus::bind).transpose()?;
        let probes = Probes::load(&LoadConfig {
            ringbuf_bytes: cfg.ringbuf_bytes,
            sched_min_ns: cfg.sched_min_ns,
            large_copy_bytes: LARGE_COPY_BYTES,
            discover: matches!(mode, Mode::Daemon(_)),
            map_entries: cfg.map_entries.to_vec(),
            sched_programs: sched == SchedSignals::Exact,
        })?;
        if let Some(path) = &cfg.jsonl {
            sinks.open_jsonl(path)?;
        }
        if let Some(otlp) = &cfg.otlp {
            sinks.start_otlp(otlp)?;
        }
        let gpu = match &cfg.nvml {
            Some(nvml_cfg) => start_nvml(nvml_cfg, &sinks)?,
            None => None,
        };
        let s = Session {
            tracking: Tracking::new(probes, mode, cfg.quotas),
            router: Router::new(CorrelatorConfig {
                retry_window_ns: cfg.retry_window_ns,
                ..CorrelatorConfig::default()
            }),
            judge: Judge::new(cfg.causes.clone(), cfg.stalls, gpu),
            sinks,
            started: Instant::now(),
            signals: Some(signals),
            record: Vec::new(),
            sched_sampler: match sched {
                SchedSignals::Exact => None,
                SchedSignals::Sampled { period } => {
                    log::info!(
                        "scheduler spells: sampled from the traced threads' /proc schedstat \
                         every {period:?} (no program on sched_switch)"
                    );
                    Some(Sampling {
                        sampler: SchedSampler::new(cfg.sched_min_ns, cfg.quotas.sampled_threads),
                        period,
                        last: tokio::time::Instant::now(),
                    })
                }
            },
        };
        Ok((s, listener))
    }
}

/// The scheduler source asked for, or the exact one where this kernel
/// keeps no per-thread counters to sample (no CONFIG_SCHED_INFO): spells
/// from the switch program rather than none.
fn sched_source(asked: SchedSignals) -> SchedSignals {
    if matches!(asked, SchedSignals::Sampled { .. }) && !schedstat::readable() {
        log::warn!(
            "scheduler spells: {} does not read on this kernel (no CONFIG_SCHED_INFO), so they \
             come from a program on sched_switch (--sched exact), which every context switch of \
             the host runs",
            schedstat::own_file()
        );
        return SchedSignals::Exact;
    }
    asked
}

/// GPU readings through NVML, or None (said in the log) where it is absent.
fn start_nvml(cfg: &nvml::NvmlConfig, sinks: &Sinks) -> Result<Option<Sampler>> {
    match nvml::start(cfg, sinks.series.registry())? {
        nvml::Started::Sampler(sampler) => {
            let gpus: Vec<String> = sampler
                .gpus()
                .iter()
                .map(|g| format!("{} {} ({})", g.index, g.name, g.uuid))
                .collect();
            log::info!(
                "NVML: sampling every {:?}: {}",
                sampler.period(),
                gpus.join(", ")
            );
            Ok(Some(sampler))
        }
        nvml::Started::Unavailable(reason) => {
            log::info!("{reason}; GPU readings are off, everything else works");
            Ok(None)
        }
    }
}
