//! Root-only: the real eBPF programs loaded into this kernel, attached to
//! the stub and real CUDA runtimes, compared with the workload's own
//! ground-truth timestamps.

use std::time::Duration;

use anyhow::Result;
use ttft_trace::jsonl_schema::Episode;
use ttft_trace_tests::{
    fixtures::{self, Style, TruthEpisode, Variant, Workload},
    tracer::{TraceOutput, Tracer, http_get, root_test, run_tracer},
};

/// Per-episode agreement with ground truth. The workload reads the clock
/// just before its first launch call and just after the completing call
/// returns; the probes stamp inside those calls, so the traced latency is a
/// little shorter by the probe entry and return paths.
const TOLERANCE_NS: u64 = 100_000;
/// How short an excused episode (see [`compare`]) may be: the workload held
/// up between its stamp and its call for a few of the scheduler's slices on
/// a busy 2-CPU machine; a probe that missed a launch or a copy would show
/// in the counts, or in many episodes. Episodes from the move of a
/// process's launches to the driver on are held to [`MOVE_HOLD_MAX_NS`].
const EXCUSED_SHORT_MAX_NS: u64 = 5_000_000;

/// How late an episode's first launch may be stamped while the runtime's
/// launch probes are detached (see [`moved_to_driver`]): each uprobe's
/// removal waits for a grace period, 68-124 ms measured on Linux 6.18
/// (`ttft-trace/src/probes/detach.rs`); a thread held by it is held no longer.
const MOVE_HOLD_MAX_NS: u64 = 150_000_000;

/// The index of the first episode traced at the driver after episodes
/// traced at the runtime, if the process's launches moved there. The
/// runtime's launch probes are then detached one by one, which rewrites
/// the runtime's code pages while the process runs: a thread that enters a
/// launch meanwhile waits on the kernel before the driver's probe stamps
/// it. Locally the episodes held so were the move's or up to four after it,
/// 2.5-6 ms late at their start; CI saw one held 15.5 ms, and in one run
/// four, 0 to 44 episodes after the move (0.1-13.7 ms late; the detaches
/// take 0.7 s). That wait is the kernel's, not a missed probe: counts, the
/// traced window inside the truth's and the copy's end are still checked.
fn moved_to_driver(traced: &[Episode]) -> Option<usize> {
    let first = traced.iter().position(|t| t.api == "driver")?;
    (first > 0 && traced[0].api == "runtime").then_some(first)
}

/// Starts `workload` stopped, attaches a tracer (`extra` args), lets the
/// workload run to its end and returns the tracer's output and the truth.
fn trace(
    workload: Workload,
    extra: &[&str],
    libraries: usize,
) -> Result<(TraceOutput, Vec<TruthEpisode>)> {
    let truth_path = fixtures::temp_path("truth", "jsonl");
    let mut child = workload.truth(&truth_path).spawn_stopped()?;
    let mut args = vec!["--pid".to_string(), child.id().to_string()];
    args.extend(extra.iter().map(|s| s.to_string()));
    let tracer = Tracer::start(&args, libraries)?;
    fixtures::cont(child.id())?;
    child.wait_timeout(Duration::from_secs(60))?;
    let out = tracer.finish(Duration::from_secs(20))?;
    let truth = fixtures::read_truth(&truth_path)?;
    let _ = std::fs::remove_file(&truth_path);
    assert!(out.success, "tracer failed:\n{}", out.stderr);
    Ok((out, truth))
}

/// Errors of each episode's latency against ground truth, in ns (truth - traced).
///
/// One episode in twenty (at least one) may be short by more than the
/// tolerance: the fixture stamps its truth right before the first launch
/// call and right after the completing call returns, and a thread held up
/// between a stamp and its call is traced from the call. On this VM's two
/// CPUs that is preemption (the workload's emulated kernels and the tracer
/// keep both busy), or the tracer attaching a new child's uprobes, which
/// writes the child's code pages while it runs. CI saw one such episode in
/// 30, short by 125-300 µs, at its start or its end, with either scheduler
/// source.
fn compare(traced: &[Episode], truth: &[TruthEpisode]) -> Vec<i64> {
    compare_except(traced, truth, 0)
}

/// The number of runtime launch probes the tracer said it detached when the
/// process's launches moved to the driver (0 if they did not).
fn detached_at_the_move(stderr: &str) -> usize {
    stderr
        .lines()
        .filter_map(|l| {
            let (_, tail) = l
                .split_once("reached it (")
                .or_else(|| l.split_once("reach it ("))?;
            tail.split_whitespace().next()?.parse::<usize>().ok()
        })
        .sum()
}

/// As [`compare`], where the process's launches moved to the driver while
/// it ran and the tracer detached `move_holds` runtime launch probes: each
/// detach rewrites the runtime's code in the process once, and may hold the
/// thread in a launch then (see [`moved_to_driver`]). Up to that many
/// episodes from the move on may be short by up to [`MOVE_HOLD_MAX_NS`], at
/// their start only, beside the one in twenty of [`compare`]; each is
/// printed with how much of it is at the start and at the end; counts, and
/// the traced window inside the truth's, are still checked for all.
fn compare_except(traced: &[Episode], truth: &[TruthEpisode], move_holds: usize) -> Vec<i64> {
    let short = truth.len() / 20 + 1;
    let (mut late, mut held) = (0, 0);
    let moved = moved_to_driver(traced);
    assert_eq!(traced.len(), truth.len(), "episode count");
    let mut errors = Vec::new();
    for (i, (t, g)) in traced.iter().zip(truth).enumerate() {
        assert_eq!((t.pid, t.tid), (g.pid, g.tid), "episode {i} thread");
        assert_eq!(
            u64::from(t.kernel_launches),
            g.kernel_launches,
            "episode {i} kernel launches"
        );
        assert_eq!(
            u64::from(t.graph_launches),
            g.graph_launches,
            "episode {i} graph launches"
        );
        assert_eq!(t.copy_bytes, g.d2h_bytes, "episode {i} copy bytes");
        assert!(
            t.t_first_launch_ns >= g.t_launch_ns && t.t_copy_done_ns <= g.t_complete_ns,
            "episode {i}: traced window [{}, {}] not inside truth [{}, {}]",
            t.t_first_launch_ns,
            t.t_copy_done_ns,
            g.t_launch_ns,
            g.t_complete_ns
        );
        let err = g.gpu_ns() as i64 - t.launch_to_first_d2h_ns as i64;
        errors.push(err);
        if err <= TOLERANCE_NS as i64 {
            assert!(
                err.unsigned_abs() <= TOLERANCE_NS,
                "episode {i}: traced {} ns vs truth {} ns",
                t.launch_to_first_d2h_ns,
                g.gpu_ns()
            );
            continue;
        }
        let start_late = t.t_first_launch_ns - g.t_launch_ns;
        let end_early = g.t_complete_ns - t.t_copy_done_ns;
        eprintln!(
            "episode {i} ({}, the move to the driver at {moved:?}): traced {} ns vs truth {} ns: \
             the first launch stamped {start_late} ns after the truth's start, the copy done \
             {end_early} ns before its end",
            t.api,
            t.launch_to_first_d2h_ns,
            g.gpu_ns(),
        );
        // Held at its start while the runtime's probes were detached: from
        // the episode before the first at the driver on, the copy's end
        // still exact.
        let held_by_the_move = held < move_holds
            && moved.is_some_and(|m| i + 1 >= m)
            && end_early <= TOLERANCE_NS
            && err.unsigned_abs() <= MOVE_HOLD_MAX_NS;
        if held_by_the_move {
            held += 1;
            continue;
        }
        late += 1;
        assert!(
            late <= short && err.unsigned_abs() <= EXCUSED_SHORT_MAX_NS,
            "episode {i}: traced {} ns vs truth {} ns: short by more than the tolerance, {late} \
             such of {} (up to {short} excused, by up to {EXCUSED_SHORT_MAX_NS} ns; {held} of \
             up to {move_holds} held by the move to the driver)",
            t.launch_to_first_d2h_ns,
            g.gpu_ns(),
            truth.len()
        );
    }
    errors
}

/// The traced episodes of a process the probes reached while it ran, and
/// the truth episodes they must match one for one. The first traced one is
/// inside some truth episode's window (one that spanned two would be an
/// episode's launches joined to the next one's copy). It may have begun
/// before the launch probes were all in, with fewer launches than the
/// truth: it is then left out, with the truth up to it.
fn after_attach(traced: &[Episode], truth: &[TruthEpisode]) -> (Vec<Episode>, Vec<TruthEpisode>) {
    let Some(first) = traced.first() else {
        return (Vec::new(), Vec::new());
    };
    let at = truth
        .iter()
        .position(|g| {
            g.t_launch_ns <= first.t_first_launch_ns && first.t_copy_done_ns <= g.t_complete_ns
        })
        .unwrap_or_else(|| {
            panic!("the first traced episode is inside no truth episode: {first:?}")
        });
    let launches = u64::from(first.kernel_launches + first.graph_launches);
    if launches < truth[at].launches() {
        eprintln!(
            "the first traced episode began as the probes came: {launches} of {} launches",
            truth[at].launches()
        );
        return (traced[1..].to_vec(), truth[at + 1..].to_vec());
    }
    (traced.to_vec(), truth[at..].to_vec())
}

fn report(name: &str, mut errors: Vec<i64>) {
    errors.sort_unstable();
    let abs_max = errors.iter().map(|e| e.unsigned_abs()).max().unwrap_or(0);
    eprintln!(
        "{name}: {} episodes, error (truth - traced) median {} ns, max |error| {} ns",
        errors.len(),
        errors.get(errors.len() / 2).copied().unwrap_or(0),
        abs_max
    );
}

fn check_totals(out: &TraceOutput, truth: &[TruthEpisode]) {
    let totals = out.totals().expect("a totals line");
    let kernel: u64 = truth.iter().map(|t| t.kernel_launches).sum();
    let graph: u64 = truth.iter().map(|t| t.graph_launches).sum();
    let d2h: u64 = truth.iter().map(|t| t.d2h_bytes).sum();
    let h2d: u64 = truth.iter().map(|t| t.h2d_bytes).sum();
    assert_eq!(totals.kernel_launches, kernel, "{totals:?}");
    assert_eq!(totals.graph_launches, graph, "{totals:?}");
    assert_eq!(totals.memcpy_bytes.get("d2h"), Some(&d2h), "{totals:?}");
    assert_eq!(totals.memcpy_bytes.get("h2d"), Some(&h2d), "{totals:?}");
    assert_eq!(totals.events_lost, 0, "{totals:?}");
}

#[test]
fn every_completion_style_matches_ground_truth() -> Result<()> {
    let Some(_g) = root_test("every_completion_style_matches_ground_truth") else {
        return Ok(());
    };
    for style in Style::ALL {
        let w = Workload::new(style)
            .episodes(30)
            .launches(5)
            .kernel_us(300)
            .copy_bytes(8192)
            .h2d_bytes(1024)
            .gap_us(2000);
        let (out, truth) = trace(w, &[], 2)?;
        let traced = out.episodes();
        let errors = compare(&traced, &truth);
        check_totals(&out, &truth);
        let want = match style {
            Style::Sync | Style::DriverSync => "sync_copy",
            Style::Event => "event_sync",
            Style::Device => "context_sync",
            _ => "stream_sync",
        };
        for t in &traced {
            assert_eq!(t.status, 0);
            // cudaDeviceSynchronize ends in cuCtxSynchronize: the runtime call
            // is what completes it, seen as device_sync.
            let want = if style == Style::Device {
                "device_sync"
            } else {
                want
            };
            assert_eq!(t.completion, want, "{style}");
            let api = if style.is_driver() {
                "driver"
            } else {
                "runtime"
            };
            assert_eq!(
                t.api, api,
                "{style}: runtime calls must not be counted again at the driver"
            );
        }
        report(style.as_str(), errors);
    }
    Ok(())
}

/// A runtime whose launches all reach the driver's probed entry points
/// shows it within 256 launches; the process's launches are then traced at
/// the driver alone (one trap per launch), and every episode stays exact
/// across the change. With host-wide probes (the daemon's reach) the same,
/// for the runtime file, on the evidence of the traced processes mapping it.
#[test]
fn launches_move_to_the_driver_once_the_runtime_shows_it_reaches_it() -> Result<()> {
    let Some(_g) = root_test("launches_move_to_the_driver_once_the_runtime_shows_it_reaches_it")
    else {
        return Ok(());
    };
    let runs: [(Style, &[&str]); 4] = [
        (Style::Stream, &[]),
        (Style::LaunchEx, &[]),
        (Style::Graph, &[]),
        (Style::Stream, &["--host-wide-probes"]),
    ];
    for (style, extra) in runs {
        let w = Workload::new(style)
            .episodes(150)
            .launches(4)
            .gap_us(10_000);
        let (out, truth) = trace(w, extra, 2)?;
        let traced = out.episodes();
        // Detaching the runtime's launch probes rewrites the runtime's code
        // pages in the process: a thread inside a launch then may wait on
        // the kernel, before the driver's probe stamps its first launch.
        let detached = detached_at_the_move(&out.stderr);
        assert!(detached > 0, "{style}: no probes detached: {}", out.stderr);
        let errors = compare_except(&traced, &truth, detached);
        check_totals(&out, &truth);
        let pid = truth[0].pid;
        let said = if extra.is_empty() {
            format!("launches of pid {pid} are traced at the driver")
        } else {
            format!("{} are traced at the driver", fixtures::STUB_CUDART)
        };
        assert!(out.stderr.contains(&said), "{style}: {}", out.stderr);
        let apis: Vec<&str> = traced.iter().map(|t| t.api.as_str()).collect();
        let at_driver = apis.iter().filter(|a| **a == "driver").count();
        assert_eq!(apis[0], "runtime", "{style}: {apis:?}");
        assert_eq!(apis[apis.len() - 1], "driver", "{style}: {apis:?}");
        // The runtime's probes are gone once, for good: no episode after
        // the first at the driver goes back to the runtime.
        let first = apis.iter().position(|a| *a == "driver").unwrap_or(0);
        assert!(
            apis[first..].iter().all(|a| *a == "driver"),
            "{style}: {apis:?}"
        );
        eprintln!(
            "{style}: the last {at_driver} of {} episodes traced at the driver alone \
             ({detached} runtime launch probes detached)",
            apis.len()
        );
        report(style.as_str(), errors);
    }
    Ok(())
}

#[test]
fn launch_arguments_are_decoded() -> Result<()> {
    let Some(_g) = root_test("launch_arguments_are_decoded") else {
        return Ok(());
    };
    for style in [Style::Stream, Style::LaunchEx, Style::Graph, Style::Driver] {
        let (out, truth) = trace(Workload::new(style).episodes(3), &[], 2)?;
        for (t, g) in out.episodes().iter().zip(&truth) {
            assert_eq!(
                t.stream,
                format!("{:#x}", g.stream),
                "{style}: stream argument"
            );
        }
    }
    Ok(())
}

#[test]
fn per_thread_default_stream_and_worker_threads() -> Result<()> {
    let Some(_g) = root_test("per_thread_default_stream_and_worker_threads") else {
        return Ok(());
    };
    let (out, truth) = trace(Workload::new(Style::Stream).episodes(10).ptsz(true), &[], 2)?;
    report("ptsz", compare(&out.episodes(), &truth));
    let (out, truth) = trace(Workload::new(Style::Sync).episodes(10).thread(true), &[], 2)?;
    let traced = out.episodes();
    assert!(
        traced.iter().all(|t| t.tid != t.pid),
        "work ran on a second thread"
    );
    report("thread", compare(&traced, &truth));
    Ok(())
}

#[test]
fn hashed_and_static_runtimes_are_found() -> Result<()> {
    let Some(_g) = root_test("hashed_and_static_runtimes_are_found") else {
        return Ok(());
    };
    let (out, truth) = trace(
        Workload::new(Style::Stream)
            .variant(Variant::Hashed)
            .episodes(10),
        &[],
        2,
    )?;
    out.assert_attached(fixtures::STUB_CUDART_HASHED);
    report("hashed", compare(&out.episodes(), &truth));

    // The runtime linked statically into an extension: symbols only in .symtab.
    let (out, truth) = trace(
        Workload::new(Style::Event)
            .variant(Variant::ExtHost)
            .episodes(10),
        &[],
        2,
    )?;
    out.assert_attached(fixtures::EXT_MODULE);
    report("static-in-extension", compare(&out.episodes(), &truth));
    Ok(())
}

#[test]
fn real_libcudart_probes_fire() -> Result<()> {
    let Some(_g) = root_test("real_libcudart_probes_fire") else {
        return Ok(());
    };
    let Some(real) = fixtures::real_cudart("real_libcudart_probes_fire") else {
        return Ok(());
    };
    for style in [Style::Stream, Style::Sync, Style::Event, Style::Graph] {
        let w = Workload::new(style)
            .variant(Variant::Real)
            .episodes(10)
            .launches(3);
        let (out, truth) = trace(w, &[], 1)?;
        out.assert_attached(&real.display().to_string());
        let traced = out.episodes();
        assert_eq!(traced.len(), truth.len(), "{style}");
        for (t, g) in traced.iter().zip(&truth) {
            // No GPU: every call fails with cudaErrorInsufficientDriver, and
            // the episode is still seen, with that status.
            assert_eq!(
                t.status,
                fixtures::CUDA_ERROR_INSUFFICIENT_DRIVER,
                "{style}"
            );
            assert_eq!(
                u64::from(t.kernel_launches + t.graph_launches),
                g.launches()
            );
        }
        check_totals(&out, &truth);
    }
    // Without a GPU the real runtime fails every launch before the driver:
    // it never shows its launches reaching the driver's probes, and keeps
    // its own however many it makes.
    let w = Workload::new(Style::Stream)
        .variant(Variant::Real)
        .episodes(100)
        .launches(3);
    let (out, truth) = trace(w, &[], 1)?;
    assert_eq!(out.episodes().len(), truth.len());
    assert!(out.episodes().iter().all(|t| t.api == "runtime"));
    assert!(
        !out.stderr.contains("traced at the driver"),
        "{}",
        out.stderr
    );
    check_totals(&out, &truth);
    Ok(())
}

#[test]
fn child_process_doing_the_gpu_work_is_followed() -> Result<()> {
    let Some(_g) = root_test("child_process_doing_the_gpu_work_is_followed") else {
        return Ok(());
    };
    // The parent is stopped before it forks: the child is born after
    // attach, and launches at once. With the probes in every process that
    // maps the library, it is traced from its first call.
    let (out, truth) = trace(
        Workload::new(Style::Stream).episodes(15).fork_child(true),
        &["--host-wide-probes"],
        2,
    )?;
    let traced = out.episodes();
    assert!(!truth.is_empty());
    let parent = truth[0].pid;
    assert!(
        traced.iter().all(|t| t.pid == parent),
        "child pid as in truth"
    );
    report("fork-child, host-wide probes", compare(&traced, &truth));

    // By default the probes are bound to each traced process: the kernel
    // announces the child at its fork and its own are attached then, a few
    // milliseconds later. What it launched before is not seen; every
    // episode after is, exactly. 60 episodes about 6 ms apart: at least
    // the second half (180 ms after its birth) must be traced.
    let (out, truth) = trace(
        Workload::new(Style::Stream)
            .episodes(60)
            .gap_us(5_000)
            .fork_child(true),
        &[],
        2,
    )?;
    let (traced, seen) = after_attach(&out.episodes(), &truth);
    assert!(
        seen.len() * 2 >= truth.len(),
        "{} of {} episodes traced",
        seen.len(),
        truth.len()
    );
    eprintln!(
        "fork-child, probes bound to the child at its fork: the first {} of {} episodes \
         missed, the child's first traced launch {:.1} ms after its first",
        truth.len() - seen.len(),
        truth.len(),
        traced
            .first()
            .map_or(f64::NAN, |t| (t.t_first_launch_ns - truth[0].t_launch_ns)
                as f64
                / 1e6)
    );
    report(
        "fork-child, probes bound to the child",
        compare(&traced, &seen),
    );
    Ok(())
}

#[test]
fn library_loaded_after_attach_wait() -> Result<()> {
    let Some(_g) = root_test("library_loaded_after_attach_wait") else {
        return Ok(());
    };
    let truth_path = fixtures::temp_path("truth", "jsonl");
    let mut child = Workload::new(Style::Stream)
        .variant(Variant::Dl)
        .dlopen_delay_ms(700)
        .episodes(60)
        .gap_us(5000)
        .truth(&truth_path)
        .spawn_stopped()?;
    let args = vec!["--pid".to_string(), child.id().to_string(), "--wait".into()];
    let mut tracer = Tracer::start(&args, 0)?;
    // Held until the tracer waits: its start-up (about 0.9 s of probe
    // loading here, more under load) could otherwise outlast the delay,
    // and the library be mapped before the tracer looked.
    tracer.wait_for_stderr("waiting for pid", 1, Duration::from_secs(30))?;
    fixtures::cont(child.id())?;
    child.wait_timeout(Duration::from_secs(30))?;
    let out = tracer.finish(Duration::from_secs(20))?;
    assert!(out.success, "{}", out.stderr);
    let truth = fixtures::read_truth(&truth_path)?;
    let attached_at = out
        .attach_lines()
        .iter()
        .map(|a| a.t_ns)
        .max()
        .expect("attach line");
    // Episodes that began after the probes were in place are all seen; the
    // ones in the few ms between dlopen and the next scan can be missed.
    let after: Vec<&TruthEpisode> = truth
        .iter()
        .filter(|t| t.t_launch_ns > attached_at)
        .collect();
    let traced = out.episodes();
    // The attach comes within a poll (10 ms) and the uprobes' creation of
    // the dlopen alone; run right after the fork-child test it came 30-40 ms
    // later (the kernel still busy with that test's uprobes, presumably):
    // 60 episodes leave room for that, and at least 35 must follow it.
    eprintln!(
        "dlopen --wait: probes attached {:.1} ms after the first episode began; {} of {} after",
        attached_at.saturating_sub(truth.first().map_or(0, |t| t.t_launch_ns)) as f64 / 1e6,
        after.len(),
        truth.len()
    );
    assert!(
        after.len() >= 35,
        "only {} of {} episodes began after attach",
        after.len(),
        truth.len()
    );
    let traced_after: Vec<Episode> = traced
        .iter()
        .filter(|t| t.t_first_launch_ns > attached_at)
        .cloned()
        .collect();
    let truth_after: Vec<TruthEpisode> = after.into_iter().cloned().collect();
    // The stub runtime's launches reach its driver: once they showed it,
    // the runtime's launch probes are detached, which rewrites the
    // runtime's code pages, and a thread inside a launch may wait on the
    // kernel before the driver's probe stamps it (as in
    // `launches_move_to_the_driver_once_the_runtime_shows_it_reaches_it`;
    // CI saw one episode start 650 µs late here).
    report(
        "dlopen --wait",
        compare_except(
            &traced_after,
            &truth_after,
            detached_at_the_move(&out.stderr),
        ),
    );
    Ok(())
}

#[test]
fn target_exiting_mid_trace_ends_cleanly() -> Result<()> {
    let Some(_g) = root_test("target_exiting_mid_trace_ends_cleanly") else {
        return Ok(());
    };
    let mut child = Workload::new(Style::Stream)
        .episodes(100_000)
        .gap_us(1000)
        .spawn_stopped()?;
    let tracer = Tracer::start(&["--pid".into(), child.id().to_string()], 2)?;
    fixtures::cont(child.id())?;
    std::thread::sleep(Duration::from_millis(500));
    if let Some(c) = child.child_mut() {
        c.kill()?;
    }
    child.wait_timeout(Duration::from_secs(5))?;
    let out = tracer.finish(Duration::from_secs(20))?;
    assert!(
        out.success,
        "tracer must exit 0 when its target exits:\n{}",
        out.stderr
    );
    assert!(
        out.stdout.contains("== ttft-trace: pid"),
        "final summary:\n{}",
        out.stdout
    );
    assert!(
        out.episodes().len() > 10,
        "episodes before the kill were recorded"
    );
    assert_eq!(out.totals().map(|t| t.stop), Some("TargetExited".into()));
    Ok(())
}

#[test]
fn interrupt_prints_final_summary_and_serves_metrics() -> Result<()> {
    let Some(_g) = root_test("interrupt_prints_final_summary_and_serves_metrics") else {
        return Ok(());
    };
    let child = Workload::new(Style::Sync)
        .episodes(100_000)
        .gap_us(2000)
        .spawn_stopped()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let tracer = Tracer::start(
        &[
            "--pid".into(),
            child.id().to_string(),
            "--listen".into(),
            port.to_string(),
        ],
        2,
    )?;
    fixtures::cont(child.id())?;
    std::thread::sleep(Duration::from_millis(800));
    let body = http_get(port, "/metrics")?;
    for needle in [
        "ttft_trace_launch_to_first_d2h_seconds_bucket",
        // Per-workload series carry the workload's labels.
        "ttft_trace_cuda_kernel_launches_total{comm=\"workload\",",
        "ttft_trace_cuda_graph_launches_total{comm=\"workload\",container=\"\",namespace=\"\",pod=\"\"} 0",
        "ttft_trace_cuda_memcpy_bytes_total{comm=\"workload\",container=\"\",direction=\"d2h\",",
        "ttft_trace_events_lost_total 0",
        "ttft_trace_build_info",
    ] {
        assert!(body.contains(needle), "missing {needle}:\n{body}");
    }
    let count = metric(&body, "ttft_trace_launch_to_first_d2h_seconds_count");
    assert!(count > 0.0, "episodes in the histogram:\n{body}");
    let out = tracer.interrupt(Duration::from_secs(20))?;
    assert!(out.success, "{}", out.stderr);
    assert!(
        out.stdout.contains("launch->first D2H:   p50"),
        "{}",
        out.stdout
    );
    assert_eq!(out.totals().map(|t| t.stop), Some("Signal".into()));
    drop(child);
    Ok(())
}

#[test]
fn bad_input_gets_clear_errors() -> Result<()> {
    let Some(_g) = root_test("bad_input_gets_clear_errors") else {
        return Ok(());
    };
    let (ok, err) = run_tracer(&["attach", "--pid", "999999999", "--no-listen"])?;
    assert!(
        !ok && err.contains("no process with pid 999999999"),
        "{err}"
    );

    let mut sleeper = std::process::Command::new("sleep").arg("30").spawn()?;
    let pid = sleeper.id().to_string();
    let (ok, err) = run_tracer(&["attach", "--pid", &pid, "--no-listen"])?;
    assert!(!ok, "{err}");
    assert!(
        err.contains("maps no library that defines the CUDA"),
        "{err}"
    );
    assert!(
        err.contains("searched") && err.contains("libc"),
        "names what was searched: {err}"
    );
    assert!(err.contains("--wait"), "{err}");

    let held = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = held.local_addr()?.to_string();
    let (ok, err) = run_tracer(&["attach", "--pid", &pid, "--listen", &addr])?;
    assert!(
        !ok && err.contains("another process holds this port"),
        "{err}"
    );

    let (ok, err) = run_tracer(&[
        "attach",
        "--pid",
        &pid,
        "--no-listen",
        "--wait",
        "--wait-timeout",
        "0.3",
    ])?;
    assert!(!ok && err.contains("within the --wait-timeout"), "{err}");
    sleeper.kill()?;
    sleeper.wait()?;
    let not_cuda = fixtures::fixture("workload");
    let (ok, err) = run_tracer(&[
        "attach",
        "--pid",
        &std::process::id().to_string(),
        "--no-listen",
        "--cuda-lib",
        &not_cuda.display().to_string(),
    ])?;
    assert!(
        !ok && err.contains("defines none of the CUDA entry points"),
        "{err}"
    );
    Ok(())
}

fn metric(body: &str, name: &str) -> f64 {
    body.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}
