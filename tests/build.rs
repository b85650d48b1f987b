//! Builds the GPU-free C fixtures (stub CUDA driver and runtime, workload
//! programs; see `tests/fixtures/` and `src/fixtures.rs`) with `gcc` into the
//! stable directory `<target dir>/fixtures/`, and tells the crate where with
//! `TTFT_FIXTURE_DIR`.
//!
//! `workload_real` (and `abi_check_real`) are built only when the real
//! `libcudart.so.12` of the `nvidia-cuda-runtime-cu12` 12.9.79 wheel is found:
//! `$TTFT_TRACE_REAL_CUDART`, else
//! `${TTFT_TRACE_CACHE:-$HOME/.cache/ttft-trace}/nvidia-cuda-runtime-cu12-12.9.79/nvidia/cuda_runtime/lib/libcudart.so.12`.
//!
//! Each output is written under a temporary name and renamed into place, so a
//! concurrent build or a running fixture never sees a half-written file. An
//! output whose inputs are older and whose command line is unchanged (stored
//! in `<output>.cmd`) is not rebuilt.

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
    time::SystemTime,
};

const FIXTURE_SOURCES: &[&str] = &[
    "cuda_api.h",
    "stub_cuda.c",
    "stub_cudart.c",
    "stub_cudart.map",
    "workload.h",
    "workload_core.c",
    "workload_main.c",
    "workload_dl.c",
    "workload_ext_host.c",
    "abi_check.c",
    "abi_shim/crt/host_defines.h",
    "hosttax.c",
];

/// Where the real runtime is unpacked, relative to the cache directory.
const REAL_CUDART_IN_CACHE: &str =
    "nvidia-cuda-runtime-cu12-12.9.79/nvidia/cuda_runtime/lib/libcudart.so.12";

const CFLAGS: &[&str] = &[
    "-O2",
    "-g",
    "-std=gnu11",
    "-Wall",
    "-Wextra",
    // Keep every exported function a body of its own (no identical-code
    // folding into aliases), so one uprobe = one API function.
    "-fno-ipa-icf",
];

struct Step {
    output: &'static str,
    args: Vec<String>,
    inputs: Vec<PathBuf>,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: building the C test fixtures failed:\n{e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").ok_or("no CARGO_MANIFEST_DIR")?);
    let src = manifest_dir.join("fixtures");
    let workspace = manifest_dir
        .parent()
        .ok_or("tests crate has no parent directory")?
        .to_path_buf();
    let target = match env::var_os("CARGO_TARGET_DIR") {
        Some(t) if !t.is_empty() => {
            let t = PathBuf::from(t);
            if t.is_absolute() {
                t
            } else {
                workspace.join(t)
            }
        }
        _ => workspace.join("target"),
    };
    let out = target.join("fixtures");
    fs::create_dir_all(&out).map_err(|e| format!("creating {}: {e}", out.display()))?;

    println!("cargo:rerun-if-changed=build.rs");
    for f in FIXTURE_SOURCES {
        println!("cargo:rerun-if-changed=fixtures/{f}");
    }
    for var in [
        "TTFT_TRACE_REAL_CUDART",
        "TTFT_TRACE_CACHE",
        "HOME",
        "CARGO_TARGET_DIR",
        "CC",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rustc-env=TTFT_FIXTURE_DIR={}", out.display());

    let real = real_cudart_path();
    watch_real_cudart(&real);
    let real_present = real.is_file();

    let s = |name: &str| src.join(name);
    let common_inputs = vec![s("cuda_api.h")];
    let workload_inputs = vec![
        s("cuda_api.h"),
        s("workload.h"),
        s("workload_core.c"),
        s("workload_main.c"),
    ];
    let outdir = out.display().to_string();
    let link_dir = format!("-L{outdir}");
    let rpath_origin = "-Wl,-rpath,$ORIGIN".to_string();
    let srcs = |names: &[&str]| -> Vec<String> {
        names.iter().map(|n| s(n).display().to_string()).collect()
    };
    let include = format!("-I{}", src.display());
    let with = |extra: Vec<String>| -> Vec<String> {
        let mut v: Vec<String> = CFLAGS.iter().map(|s| s.to_string()).collect();
        v.push(include.clone());
        v.extend(extra);
        v
    };
    let shared = |soname: &str| -> Vec<String> {
        vec![
            "-fPIC".into(),
            "-shared".into(),
            "-fvisibility=hidden".into(),
            format!("-Wl,-soname,{soname}"),
        ]
    };
    let cat = |parts: Vec<Vec<String>>| -> Vec<String> { parts.concat() };

    // Stage 1: the driver, and what needs nothing built.
    let stage1 = vec![
        Step {
            output: "libcuda.so.1",
            args: with(cat(vec![
                shared("libcuda.so.1"),
                srcs(&["stub_cuda.c"]),
                vec!["-pthread".into()],
            ])),
            inputs: vec![s("cuda_api.h"), s("stub_cuda.c")],
        },
        Step {
            output: "workload_dl",
            args: with(cat(vec![
                vec!["-DWL_VARIANT=\"dl\"".into()],
                srcs(&["workload_core.c", "workload_dl.c"]),
                vec!["-ldl".into(), "-pthread".into()],
            ])),
            inputs: vec![
                s("cuda_api.h"),
                s("workload.h"),
                s("workload_core.c"),
                s("workload_dl.c"),
            ],
        },
        Step {
            output: "workload_ext_host",
            args: with(cat(vec![
                srcs(&["workload_ext_host.c"]),
                vec!["-ldl".into()],
            ])),
            inputs: vec![s("workload_ext_host.c")],
        },
        // The scripted test NVML library (its script: `<path>.script`),
        // for tracer-level tests of GPU readings; it exports with default
        // visibility, as the real libnvidia-ml does.
        Step {
            output: "libnvidia-ml-stub.so",
            args: with(cat(vec![
                vec!["-fPIC".into(), "-shared".into()],
                vec![src.join("nvml/nvml_stub.c").display().to_string()],
                vec!["-pthread".into()],
            ])),
            inputs: vec![src.join("nvml/nvml_stub.c")],
        },
        Step {
            output: "abi_check",
            args: with(srcs(&["abi_check.c"])),
            inputs: vec![s("cuda_api.h"), s("abi_check.c")],
        },
        // The host-tax micro-benchmark of `cargo xtask bench`.
        Step {
            output: "hosttax",
            args: with(srcs(&["hosttax.c"])),
            inputs: vec![s("hosttax.c")],
        },
    ];

    // Stage 2: the runtimes (link against libcuda.so.1).
    let runtime = |soname: &str| -> Vec<String> {
        with(cat(vec![
            shared(soname),
            vec![format!(
                "-Wl,--version-script={}",
                s("stub_cudart.map").display()
            )],
            srcs(&["stub_cudart.c"]),
            vec![
                link_dir.clone(),
                "-l:libcuda.so.1".into(),
                rpath_origin.clone(),
                "-pthread".into(),
            ],
        ]))
    };
    let runtime_inputs = vec![
        s("cuda_api.h"),
        s("stub_cudart.c"),
        s("stub_cudart.map"),
        out.join("libcuda.so.1"),
    ];
    let mut ext_inputs = workload_inputs.clone();
    ext_inputs.extend([s("stub_cudart.c"), out.join("libcuda.so.1")]);
    let stage2 = vec![
        Step {
            output: "libcudart.so.12",
            args: runtime("libcudart.so.12"),
            inputs: runtime_inputs.clone(),
        },
        Step {
            output: "libcudart-4e0b8a1f.so.12",
            args: runtime("libcudart-4e0b8a1f.so.12"),
            inputs: runtime_inputs,
        },
        Step {
            output: "libworkload_ext.so",
            args: with(cat(vec![
                shared("libworkload_ext.so"),
                vec![
                    "-DTTFT_STUB_STATIC_RUNTIME".into(),
                    "-DWL_EXT_MODULE".into(),
                    "-DWL_VARIANT=\"ext\"".into(),
                ],
                srcs(&["workload_core.c", "workload_main.c", "stub_cudart.c"]),
                vec![
                    link_dir.clone(),
                    "-l:libcuda.so.1".into(),
                    rpath_origin.clone(),
                    "-pthread".into(),
                ],
            ])),
            inputs: ext_inputs,
        },
    ];

    // Stage 3: linked workloads, and the real-runtime variants.
    let linked = |variant: &str, cudart: &str| -> Vec<String> {
        with(cat(vec![
            vec![format!("-DWL_VARIANT=\"{variant}\"")],
            srcs(&["workload_core.c", "workload_main.c"]),
            vec![
                link_dir.clone(),
                format!("-l:{cudart}"),
                "-l:libcuda.so.1".into(),
                rpath_origin.clone(),
                "-pthread".into(),
            ],
        ]))
    };
    let mut linked_inputs = workload_inputs.clone();
    linked_inputs.push(out.join("libcuda.so.1"));
    let mut stage3 = vec![
        Step {
            output: "workload",
            args: linked("linked", "libcudart.so.12"),
            inputs: [linked_inputs.clone(), vec![out.join("libcudart.so.12")]].concat(),
        },
        Step {
            output: "workload_hashed",
            args: linked("hashed", "libcudart-4e0b8a1f.so.12"),
            inputs: [linked_inputs, vec![out.join("libcudart-4e0b8a1f.so.12")]].concat(),
        },
    ];
    if real_present {
        let real_dir = real.parent().ok_or("real libcudart has no parent")?;
        // Only the real runtime's own directory on the run path: the stub
        // libcudart.so.12 / libcuda.so.1 next to workload_real must not be
        // picked up (and there is no libcuda.so.1 to link: WL_NO_DRIVER).
        stage3.push(Step {
            output: "workload_real",
            args: with(cat(vec![
                vec!["-DWL_NO_DRIVER".into(), "-DWL_VARIANT=\"real\"".into()],
                srcs(&["workload_core.c", "workload_main.c"]),
                vec![
                    real.display().to_string(),
                    format!("-Wl,-rpath,{}", real_dir.display()),
                    "-pthread".into(),
                ],
            ])),
            inputs: [workload_inputs.clone(), vec![real.clone()]].concat(),
        });
        let real_include = real_dir.parent().map(|p| p.join("include"));
        if let Some(inc) = real_include.filter(|i| i.join("cuda_runtime_api.h").is_file()) {
            stage3.push(Step {
                output: "abi_check_real",
                args: with(cat(vec![
                    vec![
                        "-DTTFT_ABI_REAL".into(),
                        format!("-I{}", s("abi_shim").display()),
                        format!("-I{}", inc.display()),
                    ],
                    srcs(&["abi_check.c"]),
                ])),
                inputs: [
                    common_inputs.clone(),
                    vec![
                        s("abi_check.c"),
                        s("abi_shim/crt/host_defines.h"),
                        inc.join("cuda.h"),
                        inc.join("cuda_runtime_api.h"),
                        inc.join("driver_types.h"),
                    ],
                ]
                .concat(),
            });
        }
    }

    // Outputs not built this time must not linger from an earlier build
    // (e.g. workload_real against a runtime that is gone).
    for optional in ["workload_real", "abi_check_real"] {
        if !stage3.iter().any(|s| s.output == optional) {
            let _ = fs::remove_file(out.join(optional));
            let _ = fs::remove_file(out.join(format!("{optional}.cmd")));
        }
    }

    let cc = env::var("CC")
        .ok()
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "gcc".into());
    for stage in [stage1, stage2, stage3] {
        build_stage(&cc, &out, stage)?;
    }
    Ok(())
}

fn real_cudart_path() -> PathBuf {
    if let Some(p) = env::var_os("TTFT_TRACE_REAL_CUDART").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    cache_dir().join(REAL_CUDART_IN_CACHE)
}

fn cache_dir() -> PathBuf {
    if let Some(dir) = env::var_os("TTFT_TRACE_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let home = env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/ttft-trace")
}

/// Rerun when the real runtime appears or changes. Cargo treats a
/// rerun-if-changed path that does not exist as always stale (a rerun on
/// every build), so while it is missing, watch the deepest directory on its
/// way that exists instead (its mtime changes when an entry is added), but
/// never above the cache directory (which is created for that purpose).
/// Cargo walks a watched directory whole, following symlinks: a missing
/// explicit path (`TTFT_TRACE_REAL_CUDART=/nonexistent`) once made it watch
/// `/` and loop in `/sys`, so outside the cache only the file is watched.
fn watch_real_cudart(real: &Path) {
    let cache = cache_dir();
    if !real.exists() && real.starts_with(&cache) {
        let _ = fs::create_dir_all(&cache);
        let mut dir = real.parent();
        while let Some(d) = dir.filter(|d| d.starts_with(&cache)) {
            if d.is_dir() {
                println!("cargo:rerun-if-changed={}", d.display());
                return;
            }
            dir = d.parent();
        }
    }
    // Present, or an explicit path outside the cache: the file itself (a
    // missing one reruns this script on every build).
    println!("cargo:rerun-if-changed={}", real.display());
}

fn build_stage(cc: &str, out: &Path, steps: Vec<Step>) -> Result<(), String> {
    let results: Vec<Result<(), String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = steps
            .iter()
            .map(|step| scope.spawn(move || build_step(cc, out, step)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("build thread panicked".into()))
            })
            .collect()
    });
    let errors: Vec<String> = results.into_iter().filter_map(Result::err).collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("\n"))
    }
}

fn mtime(p: &Path) -> Option<SystemTime> {
    fs::metadata(p).and_then(|m| m.modified()).ok()
}

fn build_step(cc: &str, out: &Path, step: &Step) -> Result<(), String> {
    let target = out.join(step.output);
    let stamp = out.join(format!("{}.cmd", step.output));
    let cmdline = format!("{cc} {}", step.args.join(" "));
    let up_to_date = match (mtime(&target), fs::read_to_string(&stamp)) {
        (Some(t), Ok(old)) if old == cmdline => {
            step.inputs.iter().all(|i| mtime(i).is_some_and(|m| m <= t))
        }
        _ => false,
    };
    if up_to_date {
        return Ok(());
    }
    let tmp = out.join(format!(".{}.tmp-{}", step.output, std::process::id()));
    let output = Command::new(cc)
        .args(&step.args)
        .arg("-o")
        .arg(&tmp)
        .output()
        .map_err(|e| format!("running {cc} for {}: {e}", step.output))?;
    if !output.status.success() {
        let _ = fs::remove_file(&tmp);
        return Err(format!(
            "{} failed for {} ({}):\n{cmdline}\n{}{}",
            cc,
            step.output,
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let warnings = String::from_utf8_lossy(&output.stderr);
    for line in warnings.lines().filter(|l| l.contains("warning:")) {
        println!("cargo:warning={}: {line}", step.output);
    }
    fs::rename(&tmp, &target).map_err(|e| format!("renaming {} into place: {e}", tmp.display()))?;
    fs::write(&stamp, &cmdline).map_err(|e| format!("writing {}: {e}", stamp.display()))?;
    Ok(())
}
