//! Self-checks of the GPU-free CUDA fixtures (no root needed): the workload
//! variants run, their ground truth matches what was asked, emulated device
//! time is real, and the ELF files look like the real CUDA libraries where
//! the tracer cares (versioned symbols, hidden static runtime).

use std::{
    collections::BTreeMap,
    fs,
    path::Path,
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use anyhow::{Context as _, Result, bail, ensure};
use ttft_trace_tests::fixtures::{
    self, CUDA_ERROR_INSUFFICIENT_DRIVER, ChildGuard, Style, Variant, Workload, cont,
    existing_fixture, fixture, monotonic_ns, read_truth, real_cudart, temp_path, wait_stopped,
};

/// Runs `w` with a fresh truth file and checks every record against what was
/// asked. Returns the records.
fn run_and_check(w: Workload) -> Result<Vec<fixtures::TruthEpisode>> {
    let truth = temp_path("selfcheck", "jsonl");
    let w = w.truth(&truth);
    let done = w.run()?.ensure_success()?;
    let _ = fs::remove_file(&truth);
    let t = done.truth;
    let ctx = format!("{:?}/{} ", w.variant, w.style);
    ensure!(
        t.len() == w.episodes as usize,
        "{ctx}: {} truth lines, want {}",
        t.len(),
        w.episodes
    );
    for (i, e) in t.iter().enumerate() {
        ensure!(
            e.episode == i as u64,
            "{ctx}: episode {} at line {i}",
            e.episode
        );
        ensure!(e.style == w.style.as_str(), "{ctx}: style {}", e.style);
        ensure!(
            e.variant == w.variant.truth_name(),
            "{ctx}: variant {}",
            e.variant
        );
        let (kernels, graphs) = if w.style == Style::Graph {
            (0, u64::from(w.launches))
        } else {
            (u64::from(w.launches), 0)
        };
        ensure!(
            e.kernel_launches == kernels && e.graph_launches == graphs,
            "{ctx}: launches {e:?}"
        );
        ensure!(
            e.d2h_bytes == w.copy_bytes,
            "{ctx}: d2h_bytes {}",
            e.d2h_bytes
        );
        ensure!(
            e.h2d_bytes == w.h2d_bytes,
            "{ctx}: h2d_bytes {}",
            e.h2d_bytes
        );
        ensure!(
            e.t_launch_ns <= e.t_copy_ns && e.t_copy_ns <= e.t_complete_ns,
            "{ctx}: timestamps out of order {e:?}"
        );
        ensure!(e.func != 0, "{ctx}: no func/graph handle recorded");
        if w.variant != Variant::Real {
            ensure!(e.errors == 0, "{ctx}: {} errors", e.errors);
            let min = u64::from(w.launches) * w.kernel_us * 1000;
            ensure!(
                e.gpu_ns() >= min,
                "{ctx}: episode {i} took {} ns from launch to completion, less than {} launches x {} us",
                e.gpu_ns(),
                w.launches,
                w.kernel_us
            );
        }
        if i > 0 {
            ensure!(
                e.t_launch_ns >= t[i - 1].t_complete_ns + w.gap_us * 1000,
                "{ctx}: gap between episodes shorter than {} us",
                w.gap_us
            );
        }
    }
    Ok(t)
}

fn small(style: Style) -> Workload {
    Workload::new(style)
        .episodes(3)
        .launches(3)
        .kernel_us(300)
        .copy_bytes(8192)
        .h2d_bytes(1000)
        .gap_us(200)
}

#[test]
fn every_style_runs_with_the_linked_stub() -> Result<()> {
    for style in Style::ALL {
        let t = run_and_check(small(style))?;
        let first = &t[0];
        ensure!(
            first.pid == first.tid,
            "{style}: work ran off the main thread"
        );
        if style == Style::Sync {
            ensure!(
                first.stream == 0,
                "sync style uses the legacy default stream"
            );
        } else {
            ensure!(first.stream != 0, "{style}: no stream recorded");
        }
    }
    Ok(())
}

#[test]
fn ptsz_entry_points_work() -> Result<()> {
    for style in Style::ALL.into_iter().filter(|s| !s.is_driver()) {
        let t = run_and_check(small(style).ptsz(true))?;
        ensure!(
            t[0].stream == 0,
            "--ptsz uses stream 0 (per-thread default stream)"
        );
    }
    Ok(())
}

#[test]
fn hashed_runtime_runs() -> Result<()> {
    for style in [Style::Stream, Style::Graph, Style::Driver] {
        run_and_check(small(style).variant(Variant::Hashed))?;
    }
    Ok(())
}

#[test]
fn ext_host_runs_the_hidden_runtime() -> Result<()> {
    for style in [Style::Event, Style::LaunchEx, Style::DriverSync] {
        run_and_check(small(style).variant(Variant::ExtHost))?;
    }
    Ok(())
}

#[test]
fn fork_child_and_thread() -> Result<()> {
    let truth = temp_path("fork", "jsonl");
    let w = small(Style::Stream)
        .fork_child(true)
        .thread(true)
        .truth(&truth);
    let mut child = w.spawn_guarded()?;
    let parent = child.id();
    let st = child.wait_timeout(Duration::from_secs(20))?;
    ensure!(st.success(), "fork-child workload failed: {st}");
    let t = read_truth(&truth)?;
    let _ = fs::remove_file(&truth);
    ensure!(t.len() == 3, "{} truth lines", t.len());
    ensure!(t[0].pid != parent, "the work ran in the parent");
    ensure!(
        t[0].tid != t[0].pid,
        "--thread: the work ran on the main thread"
    );
    Ok(())
}

#[test]
fn fork_child_propagates_failure() -> Result<()> {
    // A CUDA error in the child (a zero grid) is the parent's exit status.
    let f = Workload::new(Style::Stream)
        .fork_child(true)
        .arg("--grid")
        .arg("0,1,1")
        .run()?;
    ensure!(f.status.code() == Some(1), "exit {:?}", f.status);
    ensure!(
        f.stderr.contains("cudaLaunchKernel"),
        "stderr: {}",
        f.stderr
    );
    // A bad option fails before forking, exit 2.
    let f = Workload::new(Style::Stream)
        .fork_child(true)
        .arg("--no-such-option")
        .run()?;
    ensure!(f.status.code() == Some(2), "exit {:?}", f.status);
    ensure!(f.stderr.contains("unknown option"), "stderr: {}", f.stderr);
    Ok(())
}

#[test]
fn stop_before_work_then_continue() -> Result<()> {
    let truth = temp_path("stop", "jsonl");
    let w = small(Style::Event).stop_before_work(true).truth(&truth);
    let mut child = w.spawn_guarded()?;
    wait_stopped(child.id())?;
    thread::sleep(Duration::from_millis(50));
    ensure!(!truth.exists(), "work started before SIGCONT");
    let t_cont = monotonic_ns();
    cont(child.id())?;
    let st = child.wait_timeout(Duration::from_secs(20))?;
    ensure!(st.success(), "stopped workload failed: {st}");
    let t = read_truth(&truth)?;
    let _ = fs::remove_file(&truth);
    ensure!(t.len() == 3);
    ensure!(
        t[0].t_launch_ns > t_cont,
        "truth clock is not CLOCK_MONOTONIC"
    );
    Ok(())
}

fn maps_contain(pid: u32, needle: &str) -> Result<bool> {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps"))?;
    Ok(maps.lines().any(|l| l.ends_with(needle)))
}

#[test]
fn dlopen_variant_loads_the_runtime_late() -> Result<()> {
    let truth = temp_path("dl", "jsonl");
    let delay_ms = 300;
    // 50 ms between episodes: the process lives long enough after the
    // dlopen for the poll below to see the mapping.
    let w = small(Style::Stream)
        .gap_us(50_000)
        .variant(Variant::Dl)
        .dlopen(fixture(fixtures::STUB_CUDART))
        .dlopen_delay_ms(delay_ms)
        .stop_before_work(true)
        .truth(&truth);
    let mut child = w.spawn_guarded()?;
    let pid = child.id();
    wait_stopped(pid)?;
    ensure!(
        !maps_contain(pid, "/libcudart.so.12")?,
        "runtime mapped before dlopen"
    );
    ensure!(
        !maps_contain(pid, "/libcuda.so.1")?,
        "driver mapped before dlopen"
    );
    let t_cont = monotonic_ns();
    cont(pid)?;
    thread::sleep(Duration::from_millis(50));
    ensure!(
        !maps_contain(pid, "/libcudart.so.12")?,
        "runtime mapped before --dlopen-delay-ms"
    );
    let mut seen = false;
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        match maps_contain(pid, "/libcudart.so.12") {
            Ok(true) => {
                seen = true;
                break;
            }
            Ok(false) => thread::sleep(Duration::from_millis(2)),
            Err(_) => break, // exited
        }
    }
    let st = child.wait_timeout(Duration::from_secs(20))?;
    ensure!(st.success(), "workload_dl failed: {st}");
    ensure!(seen, "never saw libcudart.so.12 in /proc/PID/maps");
    let t = read_truth(&truth)?;
    let _ = fs::remove_file(&truth);
    ensure!(t.len() == 3);
    ensure!(
        t[0].t_launch_ns >= t_cont + delay_ms * 1_000_000,
        "first launch before the dlopen delay elapsed"
    );
    // Driver styles resolve cu* through the runtime's handle.
    run_and_check(small(Style::Driver).variant(Variant::Dl))?;
    // Default --dlopen path and a dlopen-ed hashed runtime.
    run_and_check(small(Style::Device).variant(Variant::Dl))?;
    run_and_check(
        small(Style::Graph)
            .variant(Variant::Dl)
            .dlopen(fixture(fixtures::STUB_CUDART_HASHED)),
    )?;
    Ok(())
}

#[test]
fn emulated_copy_bandwidth() -> Result<()> {
    // 4 MB at 2 GB/s = 2 ms of copy time, after 1 x 100 us of kernel.
    for style in [Style::Sync, Style::Stream, Style::DriverSync] {
        let t = run_and_check(
            Workload::new(style)
                .episodes(2)
                .launches(1)
                .kernel_us(100)
                .copy_bytes(4_000_000)
                .gap_us(0)
                .env("TTFT_STUB_BW_GBPS", "2"),
        )?;
        for e in &t {
            ensure!(
                e.copy_ns() >= 2_000_000,
                "{style}: copy took {} ns",
                e.copy_ns()
            );
            ensure!(
                e.gpu_ns() >= 2_100_000,
                "{style}: episode took {} ns",
                e.gpu_ns()
            );
        }
    }
    Ok(())
}

#[test]
fn bench_launches_prints_a_sane_cost() -> Result<()> {
    for (variant, style) in [
        (Variant::Linked, Style::Stream),
        (Variant::Linked, Style::Driver),
        (Variant::ExtHost, Style::Stream),
    ] {
        let b = Workload::new(style).variant(variant).run_bench(20_000)?;
        ensure!(b.launches == 20_000, "{b:?}");
        ensure!(
            b.ns_per_launch > 0.0 && b.ns_per_launch < 100_000.0,
            "{variant:?}/{style}: {b:?}"
        );
    }
    Ok(())
}

#[test]
fn cuda_errors_fail_clearly_without_ignore_errors() -> Result<()> {
    // A zero grid makes the stub driver return CUDA_ERROR_INVALID_VALUE (1),
    // the runtime cudaErrorInvalidValue (1): a clean exit 1 with a message.
    let f = Workload::new(Style::Stream)
        .arg("--grid")
        .arg("0,1,1")
        .run()?;
    ensure!(f.status.code() == Some(1), "exit {:?}", f.status);
    ensure!(
        f.stderr.contains("cudaLaunchKernel") && f.stderr.contains("error 1"),
        "stderr: {}",
        f.stderr
    );
    let truth = temp_path("err", "jsonl");
    let f = Workload::new(Style::Stream)
        .arg("--grid")
        .arg("0,1,1")
        .ignore_errors(true)
        .truth(&truth)
        .run()?
        .ensure_success()?;
    let _ = fs::remove_file(&truth);
    ensure!(
        f.truth.len() == 10 && f.truth.iter().all(|e| e.errors == 4),
        "{:?}",
        f.truth
    );
    Ok(())
}

fn tool_output(tool: &str, args: &[&str], file: &Path) -> Result<String> {
    let out = Command::new(tool)
        .args(args)
        .arg(file)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {tool}"))?;
    if !out.status.success() {
        bail!(
            "{tool} {args:?} {} failed: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn defined_symbols(nm_output: &str) -> Vec<String> {
    nm_output
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_addr, kind, name) = (f.next()?, f.next()?, f.next()?);
            (kind != "U" && kind != "w").then(|| name.to_string())
        })
        .collect()
}

#[test]
fn stub_runtime_exports_versioned_symbols() -> Result<()> {
    for lib in [fixtures::STUB_CUDART, fixtures::STUB_CUDART_HASHED] {
        let path = existing_fixture(lib)?;
        let syms = tool_output("readelf", &["--dyn-syms", "-W"], &path)?;
        for f in [
            "cudaLaunchKernel",
            "cudaLaunchKernel_ptsz",
            "cudaLaunchKernelExC",
            "cudaGraphLaunch",
            "cudaMemcpyAsync",
            "cudaMemcpyAsync_ptsz",
            "cudaMemcpy",
            "cudaStreamSynchronize",
            "cudaEventSynchronize",
            "cudaDeviceSynchronize",
        ] {
            let want = format!(" {f}@@libcudart.so.12");
            ensure!(
                syms.lines()
                    .any(|l| l.contains(" FUNC ") && l.ends_with(&want)),
                "{lib}: no{want}"
            );
        }
        let dynamic = tool_output("readelf", &["-d"], &path)?;
        ensure!(
            dynamic.contains(&format!("Library soname: [{lib}]")),
            "{lib}: soname"
        );
        ensure!(
            dynamic.contains("Shared library: [libcuda.so.1]"),
            "{lib}: not linked to libcuda.so.1"
        );
        // Every launch goes through the driver's dynamic symbols.
        let relocs = tool_output("readelf", &["-r", "-W"], &path)?;
        for f in [
            "cuLaunchKernel",
            "cuLaunchKernelEx",
            "cuGraphLaunch",
            "cuMemcpyDtoHAsync_v2",
        ] {
            ensure!(
                relocs
                    .lines()
                    .any(|l| l.split_whitespace().nth(4) == Some(f)),
                "{lib}: no relocation against {f}"
            );
        }
    }
    let driver = tool_output("nm", &["-D"], &existing_fixture(fixtures::STUB_CUDA)?)?;
    let driver = defined_symbols(&driver);
    for f in [
        "cuInit",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cuGraphLaunch",
        "cuMemcpyDtoHAsync_v2",
        "cuMemcpyDtoH_v2",
        "cuMemcpyHtoDAsync_v2",
        "cuMemcpyHtoD_v2",
        "cuMemcpyAsync",
        "cuStreamSynchronize",
        "cuEventRecord",
        "cuEventSynchronize",
        "cuCtxSynchronize",
    ] {
        ensure!(
            driver.iter().any(|s| s == f),
            "libcuda.so.1 does not export {f}"
        );
    }
    Ok(())
}

#[test]
fn ext_module_hides_the_runtime() -> Result<()> {
    let ext = existing_fixture(fixtures::EXT_MODULE)?;
    let dynamic = defined_symbols(&tool_output("nm", &["-D"], &ext)?);
    ensure!(dynamic == ["workload_main"], "dynamic exports: {dynamic:?}");
    let all = tool_output("nm", &[], &ext)?;
    for f in [
        "cudaLaunchKernel",
        "cudaMemcpyAsync",
        "cudaStreamSynchronize",
        "cudaGraphLaunch",
    ] {
        ensure!(
            all.lines().any(|l| l.ends_with(&format!(" t {f}"))),
            "{f} not a local symbol in .symtab"
        );
    }
    let dynamic = tool_output("readelf", &["-d"], &ext)?;
    ensure!(dynamic.contains("Shared library: [libcuda.so.1]"));
    ensure!(
        !dynamic.contains("libcudart"),
        "ext module links a libcudart"
    );
    for host in ["workload_ext_host", "workload_dl"] {
        let d = tool_output("readelf", &["-d"], &existing_fixture(host)?)?;
        ensure!(!d.contains("libcud"), "{host} links a CUDA library");
    }
    Ok(())
}

fn abi_lines(bin: &Path) -> Result<BTreeMap<String, i64>> {
    let out = Command::new(bin)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    ensure!(out.status.success(), "{} failed", bin.display());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').context("abi line")?;
            Ok((k.to_string(), v.parse()?))
        })
        .collect()
}

#[test]
fn header_abi_matches_cuda_12() -> Result<()> {
    let ours = abi_lines(&existing_fixture("abi_check")?)?;
    for (k, v) in [
        ("offsetof(cudaLaunchConfig_t,stream)", 32),
        ("offsetof(CUlaunchConfig,hStream)", 32),
        ("sizeof(dim3)", 12),
        ("cudaErrorInsufficientDriver", 35),
        ("cudaMemcpyDeviceToHost", 2),
        ("sizeof(CUdeviceptr)", 8),
    ] {
        ensure!(ours.get(k) == Some(&v), "{k}: {:?}, want {v}", ours.get(k));
    }
    let real = fixture("abi_check_real");
    if real.exists() {
        let theirs = abi_lines(&real)?;
        ensure!(
            ours == theirs,
            "cuda_api.h differs from the real headers:\nours {ours:?}\nreal {theirs:?}"
        );
    } else {
        eprintln!(
            "abi_check_real not built (real CUDA headers absent): compared with fixed values only"
        );
    }
    Ok(())
}

#[test]
fn real_runtime_runs_with_ignore_errors() -> Result<()> {
    let Some(lib) = real_cudart("real_runtime_runs_with_ignore_errors") else {
        return Ok(());
    };
    let syms = tool_output("readelf", &["--dyn-syms", "-W"], &lib)?;
    ensure!(syms.contains(" cudaLaunchKernel@@libcudart.so.12"));
    for style in Style::ALL.into_iter().filter(|s| !s.is_driver()) {
        let t = run_and_check(small(style).variant(Variant::Real))?;
        ensure!(
            t.iter().all(|e| e.errors > 0),
            "{style}: the real runtime succeeded without a GPU?"
        );
    }
    // Without --ignore-errors: exit 1 naming error 35.
    let f = Workload::new(Style::Stream)
        .variant(Variant::Real)
        .ignore_errors(false)
        .run()?;
    ensure!(f.status.code() == Some(1), "exit {:?}", f.status);
    ensure!(
        f.stderr
            .contains(&format!("error {CUDA_ERROR_INSUFFICIENT_DRIVER}")),
        "stderr: {}",
        f.stderr
    );
    // The driver API is refused (no libcuda.so.1 in this variant).
    let f = Workload::new(Style::Driver).variant(Variant::Real).run()?;
    ensure!(f.status.code() == Some(1), "exit {:?}", f.status);
    let b = Workload::new(Style::Stream)
        .variant(Variant::Real)
        .run_bench(1000)?;
    ensure!(b.launches == 1000);
    Ok(())
}

#[test]
fn guard_kills_a_stopped_workload() -> Result<()> {
    let w = small(Style::Stream).stop_before_work(true);
    let pid;
    {
        let g: ChildGuard = w.spawn_guarded()?;
        pid = g.id();
        wait_stopped(pid)?;
    }
    ensure!(
        fixtures::process_state(pid).is_err(),
        "process {pid} survived its guard"
    );
    Ok(())
}
