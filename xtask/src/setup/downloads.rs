//! What the tests read or run that comes from the package registries into
//! the tool cache: the real CUDA runtime and NVML libraries, and the Python
//! venvs of the deploy/ validators and the real HTTP stacks.

use std::{fs, path::PathBuf, process::Command};

use anyhow::{Context as _, Result, bail};

use super::{
    cache,
    step::{Log, Outcome, Step},
};
use crate::process::repo_root;

/// The CUDA runtime wheel whose real libcudart.so.12 the tests probe.
const CUDART_WHEEL: &str = "nvidia-cuda-runtime-cu12==12.9.79";
const CUDART_DIR: &str = "nvidia-cuda-runtime-cu12-12.9.79";

pub const CUDART: Step = Step {
    what: "libcudart.so.12 (PyPI nvidia-cuda-runtime-cu12 12.9.79)",
    log: "cudart",
    run: cudart,
};

pub const NVML: Step = Step {
    what: "libnvidia-ml.so.1 (Debian libnvidia-ml1, unpacked)",
    log: "nvml",
    run: nvml,
};

pub const VALIDATORS: Step = Step {
    what: "deploy/ validators venv (tests/deploy/requirements.txt)",
    log: "validators-venv",
    run: validators,
};

pub const HTTP_STACKS: Step = Step {
    what: "HTTP stacks venv (tests/stacks/requirements.txt)",
    log: "stacks-venv",
    run: http_stacks,
};

pub const GRPC: Step = Step {
    what: "gRPC stacks venv (tests/stacks/grpc-requirements.txt)",
    log: "grpc-venv",
    run: grpc,
};

pub fn real_cudart() -> PathBuf {
    cache()
        .join(CUDART_DIR)
        .join("nvidia/cuda_runtime/lib/libcudart.so.12")
}

/// The real libcudart.so.12 from PyPI's wheel, unpacked outside git.
fn cudart(log: &mut Log) -> Result<Outcome> {
    if real_cudart().is_file() {
        return Ok(Outcome::Found("present"));
    }
    let dl = cache().join("downloads");
    fs::create_dir_all(&dl)?;
    log.run(
        Command::new("python3")
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                CUDART_WHEEL,
                "-d",
            ])
            .arg(&dl),
    )?;
    let wheel = fs::read_dir(&dl)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.starts_with("nvidia_cuda_runtime_cu12-12.9.79") && n.ends_with(".whl")
            })
        })
        .context("pip download left no nvidia_cuda_runtime_cu12 wheel")?;
    log.run(
        Command::new("python3")
            .args(["-m", "zipfile", "-e"])
            .arg(&wheel)
            .arg(cache().join(CUDART_DIR)),
    )?;
    if !real_cudart().is_file() {
        bail!(
            "{} not found after unpacking {}",
            real_cudart().display(),
            wheel.display()
        );
    }
    Ok(Outcome::Changed("downloaded".into()))
}

/// Where fetch-real-nvml.sh unpacks the package (its own default).
fn nvml_root() -> PathBuf {
    std::env::var_os("TTFT_TRACE_NVML_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache().join("libnvidia-ml1"))
        .join("root")
}

/// The real libnvidia-ml.so.1 from Debian's non-free archive, for the NVML
/// no-driver test; the script keeps its own apt state and leaves /etc/apt alone.
fn nvml(log: &mut Log) -> Result<Outcome> {
    let found = Command::new("find")
        .arg(nvml_root())
        .args(["-name", "libnvidia-ml.so.1", "-print", "-quit"])
        .output()
        .is_ok_and(|o| !o.stdout.is_empty());
    if found {
        return Ok(Outcome::Found("present"));
    }
    let script = repo_root()?.join("tests/fixtures/nvml/fetch-real-nvml.sh");
    let lib = log.output(Command::new("bash").arg(&script))?;
    Ok(Outcome::Changed(format!("downloaded: {}", lib.trim())))
}

/// The offline validators of deploy/ (tests/deploy/requirements.txt, pinned)
/// in a venv of the cache, so that the system's Python is left alone.
fn validators(log: &mut Log) -> Result<Outcome> {
    venv(log, "validators-venv", "tests/deploy/requirements.txt")
}

/// The real HTTP stacks and clients of tests/tests/stacks.rs (uvicorn with h11
/// and httptools, hypercorn, aiohttp, gunicorn, tornado; openai, httpx) and
/// tests/tests/tls.rs (uvloop under uvicorn), pinned
/// in tests/stacks/requirements.txt, in a venv of the cache.
fn http_stacks(log: &mut Log) -> Result<Outcome> {
    venv(log, "stacks-venv", "tests/stacks/requirements.txt")
}

/// The gRPC implementations tests/tests/grpc.rs runs under the tracer, in
/// a venv of their own: a change here does not rebuild the HTTP stacks'.
fn grpc(log: &mut Log) -> Result<Outcome> {
    venv(log, "grpc-venv", "tests/stacks/grpc-requirements.txt")
}

/// A venv `name` of the cache holding `requirements` (a path in the repo),
/// rebuilt only when that file changed since it was installed.
fn venv(log: &mut Log, name: &str, requirements: &str) -> Result<Outcome> {
    let venv = cache().join(name);
    let file = repo_root()?.join(requirements);
    let want = fs::read_to_string(&file)?;
    let stamp = venv.join("requirements.installed");
    if fs::read_to_string(&stamp).is_ok_and(|have| have == want) {
        return Ok(Outcome::Found("present"));
    }
    let _ = fs::remove_dir_all(&venv);
    log.run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    log.run(
        Command::new(venv.join("bin/python"))
            .args(["-m", "pip", "install", "--disable-pip-version-check", "-r"])
            .arg(&file),
    )?;
    fs::write(&stamp, want)?;
    Ok(Outcome::Changed(format!(
        "installed into {}",
        venv.display()
    )))
}
