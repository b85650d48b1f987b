//! Uprobes on the CUDA runtime (libcudart) and driver (libcuda) APIs.
//!
//! Runtime calls nest driver calls (every `cudaLaunchKernel` ends in the
//! driver): driver calls the runtime makes are its own and are skipped, so
//! nothing is counted twice, while direct driver users (Triton, cuBLAS) are
//! still seen. The runtime's copies and synchronises have a return probe
//! and keep a per-thread depth for that. Its launches, the hot path (one
//! per kernel), have none: a trap fewer per launch. Their driver launch is
//! recognised from entries alone ([`ThreadState::note_runtime_launch`]).

use aya_ebpf::{
    Argument,
    bindings::{BPF_NOEXIST, BPF_RB_FORCE_WAKEUP},
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user},
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
};
use ttft_trace_common::{
    API_DRIVER, API_RUNTIME, Completion, Direction, EpisodeEvent, GpuCounters, Stat, ThreadState,
    launch_key,
    process::{DiscoverEvent, EVENT_DISCOVER},
    signals::{CopyEvent, EVENT_COPY},
};

use crate::{
    maps::{
        ANNOUNCED, COUNTERS, EVENTS, THREADS, bump_stat, discover, is_tracked, large_copy_bytes,
        wakeup_flag,
    },
    mem::now_ns,
};

/// The start of both `cudaLaunchConfig_t` and `CUlaunchConfig`: two dim3s
/// (six u32s), the shared-memory size (a `size_t`, or a u32 and padding),
/// the stream handle.
#[repr(C)]
#[derive(Clone, Copy)]
struct LaunchConfigHead {
    grid: [u32; 3],
    block: [u32; 3],
    _shared_mem: u64,
    stream: u64,
}

const _: () = assert!(core::mem::offset_of!(LaunchConfigHead, stream) == 32);

/// Arguments passed in registers; the rest live on the user stack.
#[cfg(bpf_target_arch = "x86_64")]
const REG_ARGS: usize = 6;
#[cfg(bpf_target_arch = "aarch64")]
const REG_ARGS: usize = 8;

/// Address of stack argument `n` (`n >= REG_ARGS`) at function entry.
#[inline(always)]
fn stack_arg_addr(ctx: &ProbeContext, n: usize) -> usize {
    // At entry on x86-64 [rsp] is the return address and the 7th argument
    // follows; on aarch64 the 9th argument is at [sp].
    #[cfg(bpf_target_arch = "x86_64")]
    let first = 1;
    #[cfg(bpf_target_arch = "aarch64")]
    let first = 0;
    8 * (n - REG_ARGS + first) + stack_pointer(ctx) as usize
}

/// Argument `n`, wherever it lives.
#[inline(always)]
fn arg<T: Argument + Copy>(ctx: &ProbeContext, n: usize) -> Option<T> {
    if n < REG_ARGS {
        return ctx.arg(n);
    }
    // SAFETY: bpf_probe_read_user checks the address.
    unsafe { bpf_probe_read_user(stack_arg_addr(ctx, n) as *const T) }.ok()
}

/// Arguments `n..n + N` as u64s: one user memory read (a good part of a
/// probe's own cost) where they are all on the stack.
#[inline(always)]
fn args<const N: usize>(ctx: &ProbeContext, n: usize) -> Option<[u64; N]> {
    if n >= REG_ARGS {
        // SAFETY: bpf_probe_read_user checks the address.
        return unsafe { bpf_probe_read_user(stack_arg_addr(ctx, n) as *const [u64; N]) }.ok();
    }
    let mut out = [0u64; N];
    for (i, v) in out.iter_mut().enumerate() {
        *v = arg(ctx, n + i)?;
    }
    Some(out)
}

/// The stack pointer at the probed entry: a call made inside another one
/// is deeper (lower) on the stack.
#[cfg(bpf_target_arch = "x86_64")]
#[inline(always)]
fn stack_pointer(ctx: &ProbeContext) -> u64 {
    // SAFETY: regs points at the probe's saved registers.
    unsafe { (*ctx.regs).rsp }
}

#[cfg(bpf_target_arch = "aarch64")]
#[inline(always)]
fn stack_pointer(ctx: &ProbeContext) -> u64 {
    // SAFETY: regs points at the probe's saved registers.
    unsafe { (*ctx.regs).sp }
}

/// The calling thread, if its process is traced: (tgid, tid).
#[inline(always)]
fn traced_thread() -> Option<(u32, u32)> {
    let id = bpf_get_current_pid_tgid();
    let tgid = (id >> 32) as u32;
    if is_tracked(tgid) {
        Some((tgid, id as u32))
    } else {
        if discover() {
            announce(tgid);
        }
        None
    }
}

/// Daemon mode: tells userspace, once per process, that an untraced process
/// calls into a probed library (a restarted server mapping the same files).
#[inline(always)]
fn announce(tgid: u32) {
    if ANNOUNCED
        .insert(tgid, now_ns(), u64::from(BPF_NOEXIST))
        .is_err()
    {
        return;
    }
    send_discover(tgid, now_ns());
}

/// Sends a [`DiscoverEvent`] for `tgid`. Rare, so it wakes the reader at
/// once: what it starts (tracing, probes) should not wait for a batch.
#[inline(always)]
pub fn send_discover(tgid: u32, t_ns: u64) {
    let ev = DiscoverEvent {
        kind: EVENT_DISCOVER,
        tgid,
        t_ns,
    };
    match EVENTS.reserve::<DiscoverEvent>(0) {
        Some(mut entry) => {
            entry.write(ev);
            entry.submit(u64::from(BPF_RB_FORCE_WAKEUP));
        }
        None => bump_stat(Stat::RingbufLost),
    }
}

/// The calling thread's ids, the time and its state, if its process is
/// traced: what every entry probe starts from.
#[inline(always)]
fn traced_call() -> Option<(u32, u32, u64, &'static mut ThreadState)> {
    let (tgid, tid) = traced_thread()?;
    let now = now_ns();
    let st = thread_state(tid)?;
    Some((tgid, tid, now, st))
}

#[inline(always)]
fn thread_state(tid: u32) -> Option<&'static mut ThreadState> {
    if let Some(p) = THREADS.get_ptr_mut(tid) {
        // SAFETY: map values live until deleted; only this thread uses its entry.
        return Some(unsafe { &mut *p });
    }
    // Ignore the result: another CPU cannot race us on our own tid, and a
    // failure shows up as the lookup below failing.
    let _ = THREADS.insert(tid, ThreadState::default(), u64::from(BPF_NOEXIST));
    match THREADS.get_ptr_mut(tid) {
        // SAFETY: as above.
        Some(p) => Some(unsafe { &mut *p }),
        None => {
            bump_stat(Stat::ThreadStateFull);
            None
        }
    }
}

#[inline(always)]
fn counters(tgid: u32) -> Option<*mut GpuCounters> {
    if let Some(p) = COUNTERS.get_ptr_mut(tgid) {
        return Some(p);
    }
    let _ = COUNTERS.insert(tgid, GpuCounters::default(), u64::from(BPF_NOEXIST));
    COUNTERS.get_ptr_mut(tgid)
}

/// Adds to a per-CPU counter: the BPF target has no compare-and-swap, so the
/// counters are per CPU and summed by userspace rather than atomic.
#[inline(always)]
fn add(field: *mut u64, v: u64) {
    // SAFETY: field points into this CPU's copy of a live map value.
    unsafe { *field = (*field).wrapping_add(v) };
}

#[inline(always)]
fn count_launch(tgid: u32, graph: bool, api: u32) {
    if let Some(c) = counters(tgid) {
        // SAFETY: c points into a live map value.
        unsafe {
            if graph {
                add(&raw mut (*c).graph_launches, 1);
            } else {
                add(&raw mut (*c).kernel_launches, 1);
            }
            if api == API_RUNTIME {
                add(&raw mut (*c).runtime_launches, 1);
            }
        }
    }
}

#[inline(always)]
fn count_copy(tgid: u32, dir: Direction, bytes: u64) {
    let i = dir as usize;
    if let Some(c) = counters(tgid)
        && i < ttft_trace_common::counters::DIRECTIONS
    {
        // SAFETY: c points into a live map value; i is bounds-checked.
        unsafe {
            add(&raw mut (*c).memcpy_calls[i], 1);
            add(&raw mut (*c).memcpy_bytes[i], bytes);
        }
    }
}

#[inline(always)]
fn emit(ep: &EpisodeEvent) {
    match EVENTS.reserve::<EpisodeEvent>(0) {
        Some(mut entry) => {
            entry.write(*ep);
            entry.submit(wakeup_flag());
        }
        None => bump_stat(Stat::RingbufLost),
    }
    if let Some(c) = counters(ep.tgid) {
        // SAFETY: c points into a live map value.
        unsafe { add(&raw mut (*c).episodes, 1) };
    }
}

/// A copy large enough to matter on its own (swap-like traffic, loading).
#[inline(always)]
fn emit_large_copy(tgid: u32, tid: u32, dir: Direction, bytes: u64, now: u64) {
    match EVENTS.reserve::<CopyEvent>(0) {
        Some(mut entry) => {
            entry.write(CopyEvent {
                kind: EVENT_COPY,
                tgid,
                tid,
                direction: dir as u32,
                bytes,
                t_ns: now,
            });
            entry.submit(wakeup_flag());
        }
        None => bump_stat(Stat::RingbufLost),
    }
}

/// What one API call does to the episode state.
#[derive(Clone, Copy)]
enum Call {
    Launch {
        stream: u64,
        graph: bool,
        /// [`launch_key`] of the launch (the graph's handle for a graph).
        key: u64,
    },
    Copy {
        dir: Direction,
        bytes: u64,
        stream: u64,
        synchronous: bool,
    },
    Sync {
        completion: Completion,
        stream: u64,
    },
}

#[inline(always)]
fn apply(st: &mut ThreadState, call: Call, now: u64, tgid: u32, tid: u32, api: u32) {
    match call {
        Call::Launch { stream, graph, .. } => {
            st.begin_call(None, 0);
            st.on_launch(now, tgid, tid, stream, api, graph);
            count_launch(tgid, graph, api);
        }
        Call::Copy {
            dir,
            bytes,
            stream,
            synchronous,
        } => {
            st.begin_call(synchronous.then_some(Completion::SyncCopy), 0);
            count_copy(tgid, dir, bytes);
            if bytes >= large_copy_bytes() {
                emit_large_copy(tgid, tid, dir, bytes, now);
            }
            if dir == Direction::DeviceToHost {
                st.on_d2h_copy(now, bytes, stream, synchronous);
            }
        }
        Call::Sync { completion, stream } => st.begin_call(Some(completion), stream),
    }
}

/// Entry of a runtime API function with a return probe: handled only when
/// outermost.
#[inline(always)]
fn runtime_entry(ctx: &ProbeContext, call: Option<Call>) -> u32 {
    let Some((tgid, tid, now, st)) = traced_call() else {
        return 0;
    };
    st.settle_launch(stack_pointer(ctx));
    if !st.enter_runtime() {
        return 0;
    }
    match call {
        Some(call) => apply(st, call, now, tgid, tid, API_RUNTIME),
        // Arguments could not be read: still a call, complete nothing.
        None => st.begin_call(None, 0),
    }
    0
}

/// Entry of a runtime launch, which has no return probe (so no depth):
/// handled unless inside another runtime call. Arguments that cannot be
/// read leave the launch to the driver's probe.
#[inline(always)]
fn runtime_launch(ctx: &ProbeContext, call: Option<Call>) -> u32 {
    let Some((tgid, tid, now, st)) = traced_call() else {
        return 0;
    };
    let sp = stack_pointer(ctx);
    match call {
        Some(call @ Call::Launch { key, .. }) if !st.in_runtime() => {
            st.note_runtime_launch(sp, key);
            apply(st, call, now, tgid, tid, API_RUNTIME);
        }
        _ => st.settle_launch(sp),
    }
    0
}

/// Entry of a driver API function: skipped inside a runtime call, and for a
/// launch, when it is the one a runtime launch makes.
#[inline(always)]
fn driver_entry(ctx: &ProbeContext, call: Option<Call>) -> u32 {
    let Some((tgid, tid, now, st)) = traced_call() else {
        return 0;
    };
    if st.in_runtime() {
        return 0;
    }
    let sp = stack_pointer(ctx);
    match call {
        Some(Call::Launch { key, .. }) => {
            if st.take_nested_launch(sp, key) {
                if let Some(c) = counters(tgid) {
                    // SAFETY: c points into a live map value.
                    unsafe { add(&raw mut (*c).runtime_launches_at_driver, 1) };
                }
                return 0;
            }
        }
        _ => st.settle_launch(sp),
    }
    match call {
        Some(call) => apply(st, call, now, tgid, tid, API_DRIVER),
        None => st.begin_call(None, 0),
    }
    0
}

#[inline(always)]
fn call_return(ctx: &RetProbeContext, runtime: bool) -> u32 {
    let Some((_, tid)) = traced_thread() else {
        return 0;
    };
    let now = now_ns();
    let Some(p) = THREADS.get_ptr_mut(tid) else {
        return 0;
    };
    // SAFETY: map value, used by this thread only.
    let st = unsafe { &mut *p };
    let outermost = if runtime {
        st.leave_runtime()
    } else {
        !st.in_runtime()
    };
    if outermost {
        let status: i32 = ctx.ret();
        if let Some(ep) = st.end_call(now, status) {
            emit(&ep);
        }
    }
    0
}

#[inline(always)]
fn copy_call(
    ctx: &ProbeContext,
    dir: Direction,
    bytes_arg: usize,
    stream_arg: Option<usize>,
) -> Option<Call> {
    let bytes: u64 = ctx.arg(bytes_arg)?;
    let (stream, synchronous) = match stream_arg {
        Some(n) => (ctx.arg(n)?, false),
        None => (0, true),
    };
    Some(Call::Copy {
        dir,
        bytes,
        stream,
        synchronous,
    })
}

/// A kernel launch from the launch configuration at `config` (both APIs'
/// `...Ex` calls).
#[inline(always)]
fn config_launch(config: u64) -> Option<Call> {
    // SAFETY: bpf_probe_read_user checks the address.
    let head: LaunchConfigHead =
        unsafe { bpf_probe_read_user(config as *const LaunchConfigHead) }.ok()?;
    Some(Call::Launch {
        stream: head.stream,
        graph: false,
        key: launch_key(head.grid, head.block),
    })
}

/// A graph launch: `(graphExec, stream)` in both APIs, the same handle.
#[inline(always)]
fn graph_launch(ctx: &ProbeContext) -> Option<Call> {
    Some(Call::Launch {
        stream: ctx.arg(1)?,
        graph: true,
        key: ctx.arg(0)?,
    })
}

// ---- Runtime API (libcudart). A return probe each, launches excepted. ----

/// `cudaLaunchKernel(func, dim3 grid, dim3 block, args, sharedMem, stream)`:
/// each dim3 takes two registers (x and y in the first), so the stream is
/// argument 7.
#[uprobe]
pub fn cuda_launch_kernel(ctx: ProbeContext) -> u32 {
    let call = || {
        let (gxy, gz, bxy, bz): (u64, u64, u64, u64) =
            (ctx.arg(1)?, ctx.arg(2)?, ctx.arg(3)?, ctx.arg(4)?);
        let grid = [gxy as u32, (gxy >> 32) as u32, gz as u32];
        let block = [bxy as u32, (bxy >> 32) as u32, bz as u32];
        Some(Call::Launch {
            stream: arg(&ctx, 7)?,
            graph: false,
            key: launch_key(grid, block),
        })
    };
    runtime_launch(&ctx, call())
}

/// `cudaLaunchKernelExC(const cudaLaunchConfig_t*, func, args)`.
#[uprobe]
pub fn cuda_launch_kernel_ex(ctx: ProbeContext) -> u32 {
    runtime_launch(&ctx, ctx.arg(0).and_then(config_launch))
}

/// `cudaGraphLaunch(graphExec, stream)`.
#[uprobe]
pub fn cuda_graph_launch(ctx: ProbeContext) -> u32 {
    runtime_launch(&ctx, graph_launch(&ctx))
}

/// `cudaMemcpyAsync(dst, src, count, kind, stream)`.
#[uprobe]
pub fn cuda_memcpy_async(ctx: ProbeContext) -> u32 {
    let dir = ctx.arg(3).map(Direction::from_cuda_kind);
    runtime_entry(&ctx, dir.and_then(|dir| copy_call(&ctx, dir, 2, Some(4))))
}

/// `cudaMemcpy(dst, src, count, kind)`: synchronous.
#[uprobe]
pub fn cuda_memcpy(ctx: ProbeContext) -> u32 {
    let dir = ctx.arg(3).map(Direction::from_cuda_kind);
    runtime_entry(&ctx, dir.and_then(|dir| copy_call(&ctx, dir, 2, None)))
}

/// `cudaStreamSynchronize(stream)`.
#[uprobe]
pub fn cuda_stream_sync(ctx: ProbeContext) -> u32 {
    let call = ctx.arg(0).map(|stream| Call::Sync {
        completion: Completion::StreamSync,
        stream,
    });
    runtime_entry(&ctx, call)
}

/// `cudaEventSynchronize(event)`.
#[uprobe]
pub fn cuda_event_sync(ctx: ProbeContext) -> u32 {
    runtime_entry(
        &ctx,
        Some(Call::Sync {
            completion: Completion::EventSync,
            stream: 0,
        }),
    )
}

/// `cudaDeviceSynchronize()`.
#[uprobe]
pub fn cuda_device_sync(ctx: ProbeContext) -> u32 {
    runtime_entry(
        &ctx,
        Some(Call::Sync {
            completion: Completion::DeviceSync,
            stream: 0,
        }),
    )
}

/// Return of every runtime entry point above.
#[uretprobe]
pub fn cuda_runtime_return(ctx: RetProbeContext) -> u32 {
    call_return(&ctx, true)
}

// ---- Driver API (libcuda). Return probes only where completion needs one. ----

/// `cuLaunchKernel(f, gx, gy, gz, bx, by, bz, sharedMem, hStream, params, extra)`.
/// `bz`, `sharedMem` and `hStream` are read together ([`args`]).
#[uprobe]
pub fn cu_launch_kernel(ctx: ProbeContext) -> u32 {
    let call = || {
        let [bz, _shared_mem, stream] = args::<3>(&ctx, 6)?;
        let grid: [u32; 3] = [ctx.arg(1)?, ctx.arg(2)?, ctx.arg(3)?];
        let block: [u32; 3] = [ctx.arg(4)?, ctx.arg(5)?, bz as u32];
        Some(Call::Launch {
            stream,
            graph: false,
            key: launch_key(grid, block),
        })
    };
    driver_entry(&ctx, call())
}

/// `cuLaunchKernelEx(const CUlaunchConfig*, f, params, extra)`.
#[uprobe]
pub fn cu_launch_kernel_ex(ctx: ProbeContext) -> u32 {
    driver_entry(&ctx, ctx.arg(0).and_then(config_launch))
}

/// `cuGraphLaunch(hGraphExec, hStream)`.
#[uprobe]
pub fn cu_graph_launch(ctx: ProbeContext) -> u32 {
    driver_entry(&ctx, graph_launch(&ctx))
}

/// `cuMemcpyDtoHAsync_v2(dstHost, srcDevice, bytes, hStream)`.
#[uprobe]
pub fn cu_memcpy_dtoh_async(ctx: ProbeContext) -> u32 {
    driver_entry(&ctx, copy_call(&ctx, Direction::DeviceToHost, 2, Some(3)))
}

/// `cuMemcpyHtoDAsync_v2(dstDevice, srcHost, bytes, hStream)`.
#[uprobe]
pub fn cu_memcpy_htod_async(ctx: ProbeContext) -> u32 {
    driver_entry(&ctx, copy_call(&ctx, Direction::HostToDevice, 2, Some(3)))
}

/// `cuMemcpyAsync(dst, src, bytes, hStream)`: unified addressing, direction unknown.
#[uprobe]
pub fn cu_memcpy_async(ctx: ProbeContext) -> u32 {
    driver_entry(&ctx, copy_call(&ctx, Direction::Unknown, 2, Some(3)))
}

/// `cuMemcpyDtoH_v2(dstHost, srcDevice, bytes)`: synchronous.
#[uprobe]
pub fn cu_memcpy_dtoh(ctx: ProbeContext) -> u32 {
    driver_entry(&ctx, copy_call(&ctx, Direction::DeviceToHost, 2, None))
}

/// `cuMemcpyHtoD_v2(dstDevice, srcHost, bytes)`: synchronous.
#[uprobe]
pub fn cu_memcpy_htod(ctx: ProbeContext) -> u32 {
    driver_entry(&ctx, copy_call(&ctx, Direction::HostToDevice, 2, None))
}

/// `cuStreamSynchronize(hStream)`.
#[uprobe]
pub fn cu_stream_sync(ctx: ProbeContext) -> u32 {
    let call = ctx.arg(0).map(|stream| Call::Sync {
        completion: Completion::StreamSync,
        stream,
    });
    driver_entry(&ctx, call)
}

/// `cuEventSynchronize(hEvent)`.
#[uprobe]
pub fn cu_event_sync(ctx: ProbeContext) -> u32 {
    driver_entry(
        &ctx,
        Some(Call::Sync {
            completion: Completion::EventSync,
            stream: 0,
        }),
    )
}

/// `cuCtxSynchronize()`.
#[uprobe]
pub fn cu_ctx_sync(ctx: ProbeContext) -> u32 {
    driver_entry(
        &ctx,
        Some(Call::Sync {
            completion: Completion::ContextSync,
            stream: 0,
        }),
    )
}

/// Return of the driver's synchronous copies and synchronise calls.
#[uretprobe]
pub fn cu_driver_return(ctx: RetProbeContext) -> u32 {
    call_return(&ctx, false)
}
