//! Which CUDA entry points are probed, and by which eBPF program.

/// Which API a symbol belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Api {
    /// libcudart (the runtime), wherever it lives: `libcudart.so.12`, a hashed
    /// copy in a wheel, or statically linked into an extension.
    Runtime,
    /// libcuda (the driver).
    Driver,
}

impl Api {
    pub fn name(self) -> &'static str {
        match self {
            Api::Runtime => "runtime",
            Api::Driver => "driver",
        }
    }

    /// The return probe shared by this API's entry points.
    pub fn return_program(self) -> &'static str {
        match self {
            Api::Runtime => "cuda_runtime_return",
            Api::Driver => "cu_driver_return",
        }
    }
}

/// One probed function.
#[derive(Clone, Copy, Debug)]
pub struct ProbedSymbol {
    /// Exported name; `_ptsz`/`_ptds` (per-thread default stream) variants are
    /// listed separately, with the same program.
    pub name: &'static str,
    pub api: Api,
    /// eBPF program for the entry.
    pub program: &'static str,
    /// Whether the return is probed too. Every runtime entry point but the
    /// launches is (the nesting depth needs it; a runtime launch's own
    /// driver launch is recognised from entries alone, one trap fewer per
    /// launch); on the driver only calls whose return completes a copy.
    pub needs_return: bool,
}

impl ProbedSymbol {
    /// Whether a call opens an episode (a kernel or graph launch) rather
    /// than copies or waits. A library's launch probes are attached last:
    /// once a launch is seen, the copy and sync that complete its episode
    /// are probed too, so an attach in the middle of a running process
    /// never joins one episode's launches to the next one's copy.
    pub fn is_launch(&self) -> bool {
        LAUNCH_PROGRAMS.contains(&self.program)
    }
}

/// Whether `program` is the entry program of a runtime launch: the probes
/// that [`super::Probes::drop_runtime_launches`] removes.
pub fn is_runtime_launch(program: &str) -> bool {
    SYMBOLS
        .iter()
        .any(|s| s.program == program && s.api == Api::Runtime && s.is_launch())
}

/// The entry programs of launch calls ([`ProbedSymbol::is_launch`]).
const LAUNCH_PROGRAMS: &[&str] = &[
    "cuda_launch_kernel",
    "cuda_launch_kernel_ex",
    "cuda_graph_launch",
    "cu_launch_kernel",
    "cu_launch_kernel_ex",
    "cu_graph_launch",
];

const fn rt(name: &'static str, program: &'static str) -> ProbedSymbol {
    ProbedSymbol {
        name,
        api: Api::Runtime,
        program,
        needs_return: true,
    }
}

const fn rt_launch(name: &'static str, program: &'static str) -> ProbedSymbol {
    ProbedSymbol {
        needs_return: false,
        ..rt(name, program)
    }
}

const fn drv(name: &'static str, program: &'static str, needs_return: bool) -> ProbedSymbol {
    ProbedSymbol {
        name,
        api: Api::Driver,
        program,
        needs_return,
    }
}

/// Every probed symbol.
pub const SYMBOLS: &[ProbedSymbol] = &[
    rt_launch("cudaLaunchKernel", "cuda_launch_kernel"),
    rt_launch("cudaLaunchKernel_ptsz", "cuda_launch_kernel"),
    rt_launch("cudaLaunchKernelExC", "cuda_launch_kernel_ex"),
    rt_launch("cudaLaunchKernelExC_ptsz", "cuda_launch_kernel_ex"),
    rt_launch("cudaGraphLaunch", "cuda_graph_launch"),
    rt_launch("cudaGraphLaunch_ptsz", "cuda_graph_launch"),
    rt("cudaMemcpyAsync", "cuda_memcpy_async"),
    rt("cudaMemcpyAsync_ptsz", "cuda_memcpy_async"),
    rt("cudaMemcpy", "cuda_memcpy"),
    rt("cudaMemcpy_ptds", "cuda_memcpy"),
    rt("cudaStreamSynchronize", "cuda_stream_sync"),
    rt("cudaStreamSynchronize_ptsz", "cuda_stream_sync"),
    rt("cudaEventSynchronize", "cuda_event_sync"),
    rt("cudaDeviceSynchronize", "cuda_device_sync"),
    drv("cuLaunchKernel", "cu_launch_kernel", false),
    drv("cuLaunchKernel_ptsz", "cu_launch_kernel", false),
    drv("cuLaunchKernelEx", "cu_launch_kernel_ex", false),
    drv("cuLaunchKernelEx_ptsz", "cu_launch_kernel_ex", false),
    drv("cuGraphLaunch", "cu_graph_launch", false),
    drv("cuGraphLaunch_ptsz", "cu_graph_launch", false),
    drv("cuMemcpyDtoHAsync_v2", "cu_memcpy_dtoh_async", false),
    drv("cuMemcpyDtoHAsync_v2_ptsz", "cu_memcpy_dtoh_async", false),
    drv("cuMemcpyHtoDAsync_v2", "cu_memcpy_htod_async", false),
    drv("cuMemcpyHtoDAsync_v2_ptsz", "cu_memcpy_htod_async", false),
    drv("cuMemcpyAsync", "cu_memcpy_async", false),
    drv("cuMemcpyAsync_ptsz", "cu_memcpy_async", false),
    drv("cuMemcpyDtoH_v2", "cu_memcpy_dtoh", true),
    drv("cuMemcpyDtoH_v2_ptds", "cu_memcpy_dtoh", true),
    drv("cuMemcpyHtoD_v2", "cu_memcpy_htod", true),
    drv("cuMemcpyHtoD_v2_ptds", "cu_memcpy_htod", true),
    drv("cuStreamSynchronize", "cu_stream_sync", true),
    drv("cuStreamSynchronize_ptsz", "cu_stream_sync", true),
    drv("cuEventSynchronize", "cu_event_sync", true),
    drv("cuCtxSynchronize", "cu_ctx_sync", true),
];

/// A library counts as a CUDA runtime or driver when it defines one of
/// these: a library that merely wraps a copy or sync call is not one.
pub const MARKERS: &[&str] = &["cudaLaunchKernel", "cudaGraphLaunch", "cuLaunchKernel"];

/// Looks a symbol name up, ignoring an ELF version suffix
/// (`cudaLaunchKernel@@libcudart.so.12` as some symbol tables spell it).
pub fn lookup(name: &str) -> Option<&'static ProbedSymbol> {
    let base = name.split('@').next().unwrap_or(name);
    SYMBOLS.iter().find(|s| s.name == base)
}

/// Every distinct eBPF program name used by [`SYMBOLS`], returns included.
pub fn program_names() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = SYMBOLS
        .iter()
        .map(|s| s.program)
        .chain([Api::Runtime.return_program(), Api::Driver.return_program()])
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_strips_versions() {
        let s = lookup("cudaLaunchKernel@@libcudart.so.12").expect("found");
        assert_eq!(s.program, "cuda_launch_kernel");
        assert_eq!(lookup("cuLaunchKernel").map(|s| s.api), Some(Api::Driver));
        assert!(lookup("cudaMalloc").is_none());
    }

    #[test]
    fn table_is_consistent() {
        let mut names: Vec<_> = SYMBOLS.iter().map(|s| s.name).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(n, names.len(), "duplicate symbol");
        assert!(
            SYMBOLS
                .iter()
                .filter(|s| s.api == Api::Runtime)
                .all(|s| s.needs_return != s.is_launch())
        );
        for m in MARKERS {
            assert!(lookup(m).is_some(), "{m} is a marker but not probed");
        }
        assert!(program_names().contains(&"cuda_runtime_return"));
        for p in LAUNCH_PROGRAMS {
            assert!(program_names().contains(p), "{p} is no program");
        }
        let launches: Vec<_> = SYMBOLS.iter().filter(|s| s.is_launch()).collect();
        assert_eq!(launches.len(), 12, "{launches:?}");
        assert!(launches.iter().all(|s| s.name.contains("Launch")));
        assert!(
            MARKERS
                .iter()
                .all(|m| lookup(m).is_some_and(|s| s.is_launch()))
        );
        assert!(is_runtime_launch("cuda_launch_kernel") && is_runtime_launch("cuda_graph_launch"));
        assert!(!is_runtime_launch("cu_launch_kernel") && !is_runtime_launch("cuda_memcpy"));
    }
}
