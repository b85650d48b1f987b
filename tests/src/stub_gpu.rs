//! The emulated device of the stub CUDA runtime (tests/fixtures), driven
//! through the runtime's own entry points as a server's GPU steps would be:
//! the load generator and the axum stack call it.

use std::{
    ffi::{CString, c_void},
    path::Path,
};

use anyhow::{Context as _, Result, bail};

/// `struct ttft_stub_kernel` of tests/fixtures/cuda_api.h: "TTFTKERN".
const STUB_KERNEL_MAGIC: u64 = 0x4e52_454b_5446_5454;
/// `cudaMemcpyDeviceToHost`.
const D2H: i32 = 2;

#[repr(C)]
struct Dim3(u32, u32, u32);

#[repr(C)]
struct Kernel {
    magic: u64,
    duration_ns: u64,
}

type Launch =
    unsafe extern "C" fn(*const c_void, Dim3, Dim3, *mut *mut c_void, usize, *mut c_void) -> i32;
type Copy = unsafe extern "C" fn(*mut c_void, *const c_void, usize, i32, *mut c_void) -> i32;
type Sync = unsafe extern "C" fn(*mut c_void) -> i32;
type Malloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> i32;

/// The stub runtime's launch, copy and synchronise, and 4 bytes of its
/// device memory. Calls on it are the caller's to serialise (a step is one
/// thread's sequence of calls).
pub struct StubGpu {
    launch: Launch,
    copy: Copy,
    sync: Sync,
    /// A device address: a number to the host (hence Send and Sync).
    dev: usize,
}

fn sym(lib: *mut c_void, name: &str) -> Result<*mut c_void> {
    let c = CString::new(name)?;
    // SAFETY: lib is a handle from dlopen; c is NUL-terminated.
    let p = unsafe { libc::dlsym(lib, c.as_ptr()) };
    if p.is_null() {
        bail!("{name} not in the CUDA runtime");
    }
    Ok(p)
}

fn dlopen(path: &Path, flags: i32) -> Result<*mut c_void> {
    let c = CString::new(path.to_str().context("library path is not UTF-8")?)?;
    // SAFETY: dlopen of the fixture libraries, kept loaded for the process.
    let lib = unsafe { libc::dlopen(c.as_ptr(), flags) };
    if lib.is_null() {
        bail!("dlopen {} failed", path.display());
    }
    Ok(lib)
}

impl StubGpu {
    /// Loads the stub runtime at `cudart` and the stub driver next to it,
    /// and allocates the device memory the steps copy from.
    pub fn load(cudart: &Path) -> Result<Self> {
        let dir = cudart.parent().context("runtime path has no directory")?;
        dlopen(
            &dir.join("libcuda.so.1"),
            libc::RTLD_NOW | libc::RTLD_GLOBAL,
        )?;
        let lib = dlopen(cudart, libc::RTLD_NOW)?;
        // SAFETY: the CUDA 12 runtime signatures (tests/fixtures/cuda_api.h).
        let (launch, copy, sync, malloc) = unsafe {
            (
                std::mem::transmute::<*mut c_void, Launch>(sym(lib, "cudaLaunchKernel")?),
                std::mem::transmute::<*mut c_void, Copy>(sym(lib, "cudaMemcpyAsync")?),
                std::mem::transmute::<*mut c_void, Sync>(sym(lib, "cudaStreamSynchronize")?),
                std::mem::transmute::<*mut c_void, Malloc>(sym(lib, "cudaMalloc")?),
            )
        };
        let mut dev = std::ptr::null_mut();
        // SAFETY: cudaMalloc writes the device pointer.
        if unsafe { malloc(&mut dev, 4) } != 0 {
            bail!("cudaMalloc failed");
        }
        Ok(Self {
            launch,
            copy,
            sync,
            dev: dev as usize,
        })
    }

    /// One step on the default stream: a kernel of `ns`, the token's 4-byte
    /// copy back, a synchronise.
    pub fn step(&self, ns: u64) -> Result<()> {
        let k = Kernel {
            magic: STUB_KERNEL_MAGIC,
            duration_ns: ns,
        };
        let mut token = 0i32;
        let stream: *mut c_void = std::ptr::null_mut();
        // SAFETY: `k` and `token` outlive the synchronisation that ends the step.
        let rc = unsafe {
            [
                (self.launch)(
                    (&raw const k).cast(),
                    Dim3(1, 1, 1),
                    Dim3(128, 1, 1),
                    std::ptr::null_mut(),
                    0,
                    stream,
                ),
                (self.copy)(
                    (&raw mut token).cast(),
                    self.dev as *const c_void,
                    4,
                    D2H,
                    stream,
                ),
                (self.sync)(stream),
            ]
        };
        if rc.iter().any(|&r| r != 0) {
            bail!("CUDA error {rc:?}");
        }
        Ok(())
    }
}
