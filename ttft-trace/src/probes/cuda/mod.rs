//! The CUDA families: the runtime (libcudart) and the driver (libcuda)
//! tables, and the policy that chooses the layer launches are probed at
//! ([`launch_layer`]).

pub mod launch_layer;

use super::family::{Family, ProbedSymbol, Role};

/// libcudart (the runtime), wherever it lives: `libcudart.so.12`, a hashed
/// copy in a wheel, or statically linked into an extension.
pub static RUNTIME: Family = Family {
    name: "runtime",
    markers: &["cudaLaunchKernel", "cudaGraphLaunch"],
    symbols: &[
        launch("cudaLaunchKernel", "cuda_launch_kernel"),
        launch("cudaLaunchKernel_ptsz", "cuda_launch_kernel"),
        launch("cudaLaunchKernelExC", "cuda_launch_kernel_ex"),
        launch("cudaLaunchKernelExC_ptsz", "cuda_launch_kernel_ex"),
        launch("cudaGraphLaunch", "cuda_graph_launch"),
        launch("cudaGraphLaunch_ptsz", "cuda_graph_launch"),
        rt("cudaMemcpyAsync", "cuda_memcpy_async"),
        rt("cudaMemcpyAsync_ptsz", "cuda_memcpy_async"),
        rt("cudaMemcpy", "cuda_memcpy"),
        rt("cudaMemcpy_ptds", "cuda_memcpy"),
        rt("cudaStreamSynchronize", "cuda_stream_sync"),
        rt("cudaStreamSynchronize_ptsz", "cuda_stream_sync"),
        rt("cudaEventSynchronize", "cuda_event_sync"),
        rt("cudaDeviceSynchronize", "cuda_device_sync"),
    ],
};

/// libcuda (the driver).
pub static DRIVER: Family = Family {
    name: "driver",
    markers: &["cuLaunchKernel"],
    symbols: &[
        launch("cuLaunchKernel", "cu_launch_kernel"),
        launch("cuLaunchKernel_ptsz", "cu_launch_kernel"),
        launch("cuLaunchKernelEx", "cu_launch_kernel_ex"),
        launch("cuLaunchKernelEx_ptsz", "cu_launch_kernel_ex"),
        launch("cuGraphLaunch", "cu_graph_launch"),
        launch("cuGraphLaunch_ptsz", "cu_graph_launch"),
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
    ],
};

/// The return program shared by the runtime's entry points.
const RUNTIME_RETURN: &str = "cuda_runtime_return";
/// The return program shared by the driver's entry points.
const DRIVER_RETURN: &str = "cu_driver_return";

/// A runtime call that completes or waits for work. Its return is probed:
/// the runtime nesting depth counts entries against returns.
const fn rt(name: &'static str, program: &'static str) -> ProbedSymbol {
    ProbedSymbol {
        name,
        program,
        returns: Some(RUNTIME_RETURN),
        role: Role::Completes,
    }
}

/// A launch, of the runtime or the driver: entry only (a runtime launch's
/// own driver launch is recognised from entries alone, one trap fewer per
/// launch).
const fn launch(name: &'static str, program: &'static str) -> ProbedSymbol {
    ProbedSymbol {
        name,
        program,
        returns: None,
        role: Role::Opens,
    }
}

/// A driver call that completes or waits for work; its return is probed
/// only where the return completes a copy or a wait.
const fn drv(name: &'static str, program: &'static str, returns: bool) -> ProbedSymbol {
    ProbedSymbol {
        name,
        program,
        returns: if returns { Some(DRIVER_RETURN) } else { None },
        role: Role::Completes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cuda_tables_are_as_measured() {
        // Every runtime call but the launches has its return probed (the
        // nesting depth needs it).
        assert!(
            RUNTIME
                .symbols
                .iter()
                .all(|s| s.returns.is_some() != s.is_launch())
        );
        let launches = |f: &Family| f.symbols.iter().filter(|s| s.is_launch()).count();
        assert_eq!((launches(&RUNTIME), launches(&DRIVER)), (6, 6));
        for f in [&RUNTIME, &DRIVER] {
            assert!(
                f.symbols
                    .iter()
                    .filter(|s| s.is_launch())
                    .all(|s| s.name.contains("Launch"))
            );
        }
        assert_eq!((RUNTIME.symbols.len(), DRIVER.symbols.len()), (14, 20));
    }
}
