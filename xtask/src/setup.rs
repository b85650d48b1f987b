//! Idempotent set-up: everything a fresh machine lacks, nothing twice.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::process::{cmd, output, repo_root};

pub const BPF_LINKER_VERSION: &str = "0.13.0";
/// The CUDA runtime wheel whose real libcudart.so.12 the tests probe.
pub const CUDART_WHEEL: &str = "nvidia-cuda-runtime-cu12==12.9.79";
const CUDART_DIR: &str = "nvidia-cuda-runtime-cu12-12.9.79";

/// The tool cache shared with build.rs and the tests.
pub fn cache() -> PathBuf {
    if let Some(dir) = std::env::var_os("TTFT_TRACE_CACHE") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/ttft-trace")
}

pub fn real_cudart() -> PathBuf {
    cache()
        .join(CUDART_DIR)
        .join("nvidia/cuda_runtime/lib/libcudart.so.12")
}

pub fn setup() -> Result<()> {
    rust_src()?;
    bpf_linker()?;
    cudart()?;
    nvml()?;
    nftables()?;
    prometheus()?;
    validators()?;
    http_stacks()?;
    http_stack_packages()?;
    systemd_analyze()?;
    bench_tools()?;
    chromium()?;
    Ok(())
}

fn rust_src() -> Result<()> {
    let installed = output(Command::new("rustup").args([
        "component",
        "list",
        "--toolchain",
        "nightly",
        "--installed",
    ]))?;
    if installed.lines().any(|l| l.starts_with("rust-src")) {
        return Ok(());
    }
    eprintln!("setup: adding rust-src to the nightly toolchain");
    cmd(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]))
}

/// bpf-linker must use the nightly's own LLVM (same major version), so it
/// is built against the libLLVM shipped inside the nightly toolchain,
/// through a prefix made of symlinks.
fn bpf_linker() -> Result<()> {
    let root = cache().join("bpf-linker");
    let bin = root.join("bin/bpf-linker");
    if bin.is_file()
        && output(Command::new(&bin).arg("--version")).is_ok_and(|v| v.contains(BPF_LINKER_VERSION))
    {
        return Ok(());
    }
    let sysroot = output(Command::new("rustc").args(["+nightly", "--print", "sysroot"]))?;
    let lib_dir = Path::new(sysroot.trim()).join("lib");
    let libllvm = fs::read_dir(&lib_dir)
        .with_context(|| format!("reading {}", lib_dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libLLVM.so.") || n.starts_with("libLLVM-"))
        })
        .with_context(|| {
            format!(
                "no libLLVM in the nightly toolchain at {}",
                lib_dir.display()
            )
        })?;
    let version = output(Command::new("rustc").args(["+nightly", "-vV"]))?;
    let major = version
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .context("nightly rustc reports no LLVM version")?
        .to_string();
    let prefix = cache().join("llvm-prefix");
    let lib64 = prefix.join("lib64");
    fs::create_dir_all(&lib64)?;
    for name in ["libLLVM.so".to_string(), file_name(&libllvm)?] {
        let link = lib64.join(name);
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&libllvm, &link)
            .with_context(|| format!("linking {}", link.display()))?;
    }
    eprintln!("setup: building bpf-linker {BPF_LINKER_VERSION} against the nightly's LLVM {major}");
    cmd(Command::new("cargo")
        .args([
            "install",
            &format!("bpf-linker@{BPF_LINKER_VERSION}"),
            "--locked",
            "--no-default-features",
            "--features",
            &format!("llvm-{major}"),
            "--root",
        ])
        .arg(&root)
        .env("LLVM_PREFIX", &prefix))?;
    let v = output(Command::new(&bin).arg("--version"))?;
    if !v.contains(BPF_LINKER_VERSION) {
        bail!("built bpf-linker reports {v:?}");
    }
    Ok(())
}

fn file_name(p: &Path) -> Result<String> {
    p.file_name()
        .and_then(|n| n.to_str())
        .map(str::to_string)
        .with_context(|| format!("odd path {}", p.display()))
}

/// The real libcudart.so.12 from PyPI's wheel, unpacked outside git.
fn cudart() -> Result<()> {
    if real_cudart().is_file() {
        return Ok(());
    }
    let dl = cache().join("downloads");
    fs::create_dir_all(&dl)?;
    eprintln!("setup: downloading {CUDART_WHEEL} (the real CUDA runtime, probed by the tests)");
    cmd(Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-q",
            CUDART_WHEEL,
            "-d",
        ])
        .arg(&dl))?;
    let wheel = fs::read_dir(&dl)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.starts_with("nvidia_cuda_runtime_cu12-12.9.79") && n.ends_with(".whl")
            })
        })
        .context("pip download left no nvidia_cuda_runtime_cu12 wheel")?;
    let dest = cache().join(CUDART_DIR);
    cmd(Command::new("python3")
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(&dest))?;
    if !real_cudart().is_file() {
        bail!(
            "{} not found after unpacking {}",
            real_cudart().display(),
            wheel.display()
        );
    }
    Ok(())
}

/// The real libnvidia-ml.so.1 from Debian's non-free archive, for the NVML
/// no-driver test; the script keeps its own apt state and leaves /etc/apt alone.
fn nvml() -> Result<()> {
    let script = repo_root()?.join("tests/fixtures/nvml/fetch-real-nvml.sh");
    let out = output(Command::new("bash").arg(&script))?;
    log_last_line("setup: real NVML library", &out);
    Ok(())
}

/// nftables (`nft`), for the tests' packet loss on a loopback port
/// (`tests/src/faults.rs`).
fn nftables() -> Result<()> {
    apt_tool("nft", "nftables", "nft, for the packet-loss tests")
}

/// systemd-analyze, for the test that verifies deploy/systemd/ttft-trace.service.
fn systemd_analyze() -> Result<()> {
    apt_tool(
        "systemd-analyze",
        "systemd",
        "systemd-analyze, to verify the systemd unit",
    )
}

/// bpftool (the bench reads the tracer's per-program run times) and
/// bpftrace (the bench's floor: empty programs on the same tracepoints).
fn bench_tools() -> Result<()> {
    apt_tool(
        "bpftool",
        "bpftool",
        "bpftool, for the bench's per-event costs",
    )?;
    apt_tool("bpftrace", "bpftrace", "bpftrace, for the bench's floor")
}

/// Debian's chromium, for the test that renders `ttft-trace report --html`
/// in a real headless browser (tests/tests/report.rs).
fn chromium() -> Result<()> {
    apt_tool(
        "chromium",
        "chromium",
        "chromium, to render the HTML report in a headless browser",
    )
}

/// Installs `package` from apt when `tool` is missing, with an `apt-get
/// update` first only if the plain install fails (a fresh image's lists may be
/// stale). Not root: says so and leaves it (the tests needing it run as root).
fn apt_tool(tool: &str, package: &str, why: &str) -> Result<()> {
    let found = Command::new("sh")
        .args([
            "-c",
            &format!("command -v {tool} || test -x /usr/sbin/{tool} || test -x /usr/bin/{tool}"),
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    if found {
        return Ok(());
    }
    if !can_install(&format!("{tool} missing (its tests run as root)"))? {
        return Ok(());
    }
    eprintln!("setup: installing {package} ({why}) with apt-get");
    apt_install(&[package])
}

/// Whether packages can be installed (root); says why not when not.
fn can_install(missing: &str) -> Result<bool> {
    let root = output(Command::new("id").arg("-u"))?.trim() == "0";
    if !root {
        eprintln!("setup: {missing}; not root, so not installing it");
    }
    Ok(root)
}

fn on_path(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// `apt-get install` of `packages`, with an `apt-get update` first only if
/// the plain install fails (a fresh image's lists may be stale).
fn apt_install(packages: &[&str]) -> Result<()> {
    let install = || {
        cmd(Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(packages)
            .env("DEBIAN_FRONTEND", "noninteractive"))
    };
    if install().is_err() {
        cmd(Command::new("apt-get").args(["update", "-q"]))?;
        install()?;
    }
    Ok(())
}

/// Debian's `prometheus` (the server and `promtool`), for the tests that run
/// a real Prometheus against the tracer and check deploy/prometheus/. The
/// tests start their own server on loopback.
fn prometheus() -> Result<()> {
    if on_path("prometheus") && on_path("promtool") {
        return Ok(());
    }
    if !can_install("prometheus/promtool missing (the live Prometheus test runs as root)")? {
        return Ok(());
    }
    eprintln!("setup: installing Debian's prometheus (server and promtool) with apt-get");
    apt_install_no_service(&["prometheus"], &["prometheus"])
}

/// nginx (the reverse proxy) and libmicrohttpd (the C server library) of
/// the real-stacks test (tests/tests/stacks.rs), which starts its own nginx
/// on loopback and builds its libmicrohttpd server itself.
fn http_stack_packages() -> Result<()> {
    let nginx = Path::new("/usr/sbin/nginx").is_file();
    let mhd = Path::new("/usr/include/microhttpd.h").is_file();
    if nginx && mhd {
        return Ok(());
    }
    if !can_install("nginx or libmicrohttpd-dev missing (the stacks test runs as root)")? {
        return Ok(());
    }
    eprintln!("setup: installing nginx-light and libmicrohttpd-dev with apt-get");
    apt_install_no_service(&["nginx-light", "libmicrohttpd-dev"], &["nginx"])
}

/// `apt_install` of packages that would start system `services`: a
/// policy-rc.d forbids it during the install (one the machine already has is
/// left alone), and a service that systemd started anyway is stopped and
/// disabled.
fn apt_install_no_service(packages: &[&str], services: &[&str]) -> Result<()> {
    let policy = Path::new("/usr/sbin/policy-rc.d");
    let ours = !policy.exists();
    if ours {
        fs::write(
            policy,
            "#!/bin/sh\n# ttft-trace setup: no service starts during its install\nexit 101\n",
        )?;
        fs::set_permissions(policy, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    }
    let installed = apt_install(packages);
    if ours {
        fs::remove_file(policy)?;
    }
    installed?;
    if Path::new("/run/systemd/system").is_dir() {
        for service in services {
            let _ = cmd(Command::new("systemctl").args(["disable", "--now", service]));
        }
    }
    Ok(())
}

/// The offline validators of deploy/ (tests/deploy/requirements.txt, pinned)
/// in a venv of the cache, so that the system's Python is left alone.
pub fn validators() -> Result<()> {
    venv(
        "validators-venv",
        "tests/deploy/requirements.txt",
        "the deploy/ validators",
    )
}

/// The real HTTP stacks and clients of tests/tests/stacks.rs (uvicorn with h11
/// and httptools, hypercorn, aiohttp, gunicorn, tornado; openai, httpx), pinned
/// in tests/stacks/requirements.txt, in a venv of the cache.
fn http_stacks() -> Result<()> {
    venv(
        "stacks-venv",
        "tests/stacks/requirements.txt",
        "the HTTP stacks",
    )
}

/// A venv `name` of the cache holding `requirements` (a path in the repo),
/// rebuilt only when that file changed since it was installed.
fn venv(name: &str, requirements: &str, what: &str) -> Result<()> {
    let venv = cache().join(name);
    let file = repo_root()?.join(requirements);
    let want = fs::read_to_string(&file)?;
    let stamp = venv.join("requirements.installed");
    if fs::read_to_string(&stamp).is_ok_and(|have| have == want) {
        return Ok(());
    }
    eprintln!("setup: installing {what} into {}", venv.display());
    let _ = fs::remove_dir_all(&venv);
    cmd(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    cmd(Command::new(venv.join("bin/python"))
        .args([
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "-r",
        ])
        .arg(&file))?;
    fs::write(&stamp, want)?;
    Ok(())
}

fn log_last_line(what: &str, out: &str) {
    if let Some(line) = out.lines().last() {
        eprintln!("{what}: {line}");
    }
}
