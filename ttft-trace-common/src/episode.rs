//! The per-thread episode state machine, run by the probes in the kernel.
//!
//! An episode opens at the first kernel or graph launch after the previous
//! episode closed, counts launches, notes the first device-to-host copy, and
//! closes when that copy is complete: at the return of a synchronous copy, or
//! at the return of the next synchronise call that covers an asynchronous one.
//! Kept free of eBPF specifics so the host unit tests exercise the same code.

use crate::event::{EVENT_EPISODE, EpisodeEvent};

/// What completed an episode's device-to-host copy.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completion {
    /// The copy itself was synchronous (`cudaMemcpy`, `cuMemcpyDtoH_v2`).
    SyncCopy = 1,
    /// `cudaStreamSynchronize` / `cuStreamSynchronize` on the copy's stream.
    StreamSync = 2,
    /// `cudaEventSynchronize` / `cuEventSynchronize`.
    EventSync = 3,
    /// `cudaDeviceSynchronize`.
    DeviceSync = 4,
    /// `cuCtxSynchronize`.
    ContextSync = 5,
}

impl Completion {
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            1 => Self::SyncCopy,
            2 => Self::StreamSync,
            3 => Self::EventSync,
            4 => Self::DeviceSync,
            5 => Self::ContextSync,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::SyncCopy => "sync_copy",
            Self::StreamSync => "stream_sync",
            Self::EventSync => "event_sync",
            Self::DeviceSync => "device_sync",
            Self::ContextSync => "context_sync",
        }
    }
}

/// No episode open.
pub const PHASE_IDLE: u32 = 0;
/// Launches seen, no device-to-host copy yet.
pub const PHASE_LAUNCHED: u32 = 1;
/// Inside a synchronous device-to-host copy call; its return completes it.
pub const PHASE_COPY_IN_CALL: u32 = 2;
/// An asynchronous device-to-host copy is enqueued; a synchronise completes it.
pub const PHASE_COPY_PENDING: u32 = 3;

/// Stream handles that mean "the default stream": `0`, `cudaStreamLegacy`
/// (1) and `cudaStreamPerThread` (2). A synchronise on one of them waits for
/// work on the blocking streams too, so it completes a copy on any stream.
const MAX_DEFAULT_STREAM: u64 = 2;

/// State of one thread, the value of the kernel's per-thread map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThreadState {
    /// The episode being built.
    pub ep: EpisodeEvent,
    /// One of the `PHASE_*` values.
    pub phase: u32,
    /// Nesting depth of runtime API calls: while above zero, driver API calls
    /// on this thread are the runtime's own and are not counted again.
    pub runtime_depth: u32,
    /// The [`Completion`] kind of the outermost call in progress whose return
    /// may complete a copy (0: none). Return probes have no arguments, so the
    /// entry probe leaves what the return needs here.
    pub pending_call: u32,
    pub _pad: u32,
    /// Stream argument of that call (for [`Completion::StreamSync`]).
    pub pending_stream: u64,
    /// Stack pointer at the entry of the runtime launch whose driver launch
    /// is not seen yet (0: none); see [`Self::note_runtime_launch`].
    pub launch_sp: u64,
    /// That launch's [`launch_key`].
    pub launch_key: u64,
}

/// What a runtime launch and the driver launch it makes share: the grid
/// and block dimensions of a kernel launch (both APIs take the same six
/// values), or the executable graph's handle (the same pointer in both).
#[inline(always)]
pub fn launch_key(grid: [u32; 3], block: [u32; 3]) -> u64 {
    let lo = u64::from(grid[0]) | u64::from(grid[1]) << 32;
    let mid = u64::from(grid[2]) | u64::from(block[0]) << 32;
    let hi = u64::from(block[1]) | u64::from(block[2]) << 32;
    lo ^ mid.rotate_left(21) ^ hi.rotate_left(42)
}

impl ThreadState {
    /// Entry of a runtime API call. True when it is the outermost one, i.e.
    /// the call the application made.
    #[inline(always)]
    pub fn enter_runtime(&mut self) -> bool {
        self.runtime_depth = self.runtime_depth.saturating_add(1);
        self.runtime_depth == 1
    }

    /// Return of a runtime API call. True when it was the outermost one.
    #[inline(always)]
    pub fn leave_runtime(&mut self) -> bool {
        if self.runtime_depth == 0 {
            // A return whose entry we did not see (attached mid-call).
            return false;
        }
        self.runtime_depth -= 1;
        self.runtime_depth == 0
    }

    /// True while a runtime API call is in progress on this thread.
    #[inline(always)]
    pub fn in_runtime(&self) -> bool {
        self.runtime_depth > 0
    }

    /// Entry of a runtime launch, which has no return probe (one trap fewer
    /// per launch) and so no depth: the driver launch the runtime makes for
    /// it is told from a direct one (Triton's, cuBLAS's) by three things
    /// together: it is the next launch probed on the thread, it is not
    /// shallower on the stack than this entry (deeper, or at the same place
    /// where the runtime tail-calls the driver), and it has the same
    /// [`launch_key`]. A direct launch that meets all three follows a
    /// runtime launch that failed before reaching the driver, from the same
    /// frame or a deeper one, with the same shape: it would go uncounted.
    #[inline(always)]
    pub fn note_runtime_launch(&mut self, sp: u64, key: u64) {
        self.launch_sp = sp;
        self.launch_key = key;
    }

    /// Entry of a driver launch at stack pointer `sp`: true when it is the
    /// one the noted runtime launch makes (not to be counted again). The
    /// note is used once either way.
    #[inline(always)]
    pub fn take_nested_launch(&mut self, sp: u64, key: u64) -> bool {
        let nested = self.launch_sp != 0 && sp <= self.launch_sp && key == self.launch_key;
        self.launch_sp = 0;
        nested
    }

    /// Entry of any other probed call at `sp`: one made after the noted
    /// runtime launch returned (not deeper than its entry) ends the note.
    #[inline(always)]
    pub fn settle_launch(&mut self, sp: u64) {
        if sp >= self.launch_sp {
            self.launch_sp = 0;
        }
    }

    /// Entry of a call whose return may complete a copy: a synchronous copy
    /// ([`Completion::SyncCopy`]) or a synchronise. Any other call clears it.
    #[inline(always)]
    pub fn begin_call(&mut self, call: Option<Completion>, stream: u64) {
        self.pending_call = match call {
            Some(c) => c as u32,
            None => 0,
        };
        self.pending_stream = stream;
    }

    /// Return of the call noted by [`Self::begin_call`].
    #[inline(always)]
    pub fn end_call(&mut self, now: u64, status: i32) -> Option<EpisodeEvent> {
        let call = Completion::from_u32(self.pending_call);
        self.pending_call = 0;
        match call {
            Some(Completion::SyncCopy) => self.on_copy_return(now, status),
            Some(c) => self.on_sync_return(now, c, self.pending_stream, status),
            None => None,
        }
    }

    /// A kernel (`graph == false`) or graph launch.
    #[inline(always)]
    pub fn on_launch(&mut self, now: u64, tgid: u32, tid: u32, stream: u64, api: u32, graph: bool) {
        if self.phase == PHASE_IDLE {
            self.ep = EpisodeEvent {
                kind: EVENT_EPISODE,
                tgid,
                tid,
                stream,
                t_first_launch_ns: now,
                ..EpisodeEvent::default()
            };
            self.phase = PHASE_LAUNCHED;
        }
        self.ep.api |= api;
        if graph {
            self.ep.graph_launches = self.ep.graph_launches.saturating_add(1);
        } else {
            self.ep.kernel_launches = self.ep.kernel_launches.saturating_add(1);
        }
    }

    /// Entry of a device-to-host copy call. Copies in other directions do not
    /// concern episodes (they are counted elsewhere).
    #[inline(always)]
    pub fn on_d2h_copy(&mut self, now: u64, bytes: u64, stream: u64, synchronous: bool) {
        if self.phase == PHASE_LAUNCHED {
            self.ep.t_copy_enqueue_ns = now;
            self.ep.copy_bytes = bytes;
            self.ep.copy_stream = stream;
            self.phase = if synchronous {
                PHASE_COPY_IN_CALL
            } else {
                PHASE_COPY_PENDING
            };
        } else if self.phase == PHASE_COPY_PENDING && synchronous {
            // A blocking copy after a pending async one returns only once the
            // earlier work is done; keep the first copy's figures.
            self.phase = PHASE_COPY_IN_CALL;
        }
    }

    /// Return of any copy call.
    #[inline(always)]
    pub fn on_copy_return(&mut self, now: u64, status: i32) -> Option<EpisodeEvent> {
        if self.phase == PHASE_COPY_IN_CALL {
            Some(self.finish(now, Completion::SyncCopy, status))
        } else {
            None
        }
    }

    /// Return of a synchronise call. `stream` matters only for
    /// [`Completion::StreamSync`]: a synchronise on another non-default
    /// stream does not cover the copy.
    #[inline(always)]
    pub fn on_sync_return(
        &mut self,
        now: u64,
        completion: Completion,
        stream: u64,
        status: i32,
    ) -> Option<EpisodeEvent> {
        if self.phase != PHASE_COPY_PENDING {
            return None;
        }
        if completion == Completion::StreamSync
            && stream != self.ep.copy_stream
            && stream > MAX_DEFAULT_STREAM
        {
            return None;
        }
        Some(self.finish(now, completion, status))
    }

    #[inline(always)]
    fn finish(&mut self, now: u64, completion: Completion, status: i32) -> EpisodeEvent {
        self.ep.t_copy_done_ns = now;
        self.ep.completion = completion as u32;
        self.ep.status = status;
        self.phase = PHASE_IDLE;
        self.ep
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{API_DRIVER, API_RUNTIME};

    fn launched(n: u32) -> ThreadState {
        let mut s = ThreadState::default();
        for i in 0..n {
            s.on_launch(100 + u64::from(i), 7, 8, 0x1000, API_RUNTIME, false);
        }
        s
    }

    #[test]
    fn sync_copy_closes_at_its_return() {
        let mut s = launched(3);
        s.on_d2h_copy(200, 4096, 0, true);
        let ep = s.on_copy_return(250, 0).expect("episode");
        assert_eq!(ep.kind, EVENT_EPISODE);
        assert_eq!((ep.tgid, ep.tid), (7, 8));
        assert_eq!(ep.kernel_launches, 3);
        assert_eq!(ep.t_first_launch_ns, 100);
        assert_eq!(ep.t_copy_enqueue_ns, 200);
        assert_eq!(ep.t_copy_done_ns, 250);
        assert_eq!(ep.latency_ns(), 150);
        assert_eq!(ep.copy_bytes, 4096);
        assert_eq!(ep.completion, Completion::SyncCopy as u32);
        assert_eq!(s.phase, PHASE_IDLE);
    }

    #[test]
    fn async_copy_waits_for_a_synchronise() {
        let mut s = launched(2);
        s.on_d2h_copy(200, 64, 0x1000, false);
        assert_eq!(
            s.on_copy_return(201, 0),
            None,
            "async return is not completion"
        );
        let ep = s
            .on_sync_return(300, Completion::StreamSync, 0x1000, 0)
            .expect("episode");
        assert_eq!(ep.t_copy_done_ns, 300);
        assert_eq!(ep.completion, Completion::StreamSync as u32);
    }

    #[test]
    fn stream_sync_on_another_stream_does_not_complete() {
        let mut s = launched(1);
        s.on_d2h_copy(200, 64, 0x1000, false);
        assert_eq!(
            s.on_sync_return(250, Completion::StreamSync, 0x2000, 0),
            None
        );
        // The default stream covers it, and so does an event or device sync.
        let ep = s.on_sync_return(260, Completion::StreamSync, 0, 0);
        assert_eq!(ep.map(|e| e.t_copy_done_ns), Some(260));
        let mut s = launched(1);
        s.on_d2h_copy(200, 64, 0x1000, false);
        let ep = s.on_sync_return(270, Completion::EventSync, 0xdead, 0);
        assert_eq!(ep.map(|e| e.completion), Some(Completion::EventSync as u32));
    }

    #[test]
    fn synchronise_without_copy_keeps_episode_open() {
        let mut s = launched(2);
        assert_eq!(s.on_sync_return(150, Completion::DeviceSync, 0, 0), None);
        s.on_launch(160, 7, 8, 0x1000, API_DRIVER, true);
        s.on_d2h_copy(170, 8, 0, true);
        let ep = s.on_copy_return(180, 35).expect("episode");
        assert_eq!((ep.kernel_launches, ep.graph_launches), (2, 1));
        assert_eq!(ep.api, API_RUNTIME | API_DRIVER);
        assert_eq!(ep.status, 35);
    }

    #[test]
    fn copy_without_launch_is_no_episode() {
        let mut s = ThreadState::default();
        s.on_d2h_copy(10, 8, 0, true);
        assert_eq!(s.on_copy_return(20, 0), None);
        s.on_d2h_copy(30, 8, 0, false);
        assert_eq!(s.on_sync_return(40, Completion::DeviceSync, 0, 0), None);
    }

    #[test]
    fn only_the_first_copy_counts_and_next_episode_starts_fresh() {
        let mut s = launched(1);
        s.on_d2h_copy(200, 10, 0, false);
        s.on_d2h_copy(210, 20, 0, false);
        s.on_launch(220, 7, 8, 0, API_RUNTIME, false);
        let ep = s
            .on_sync_return(300, Completion::ContextSync, 0, 0)
            .expect("episode");
        assert_eq!((ep.copy_bytes, ep.t_copy_enqueue_ns), (10, 200));
        assert_eq!(ep.kernel_launches, 2);
        s.on_launch(400, 7, 8, 0x5, API_DRIVER, false);
        assert_eq!(s.ep.t_first_launch_ns, 400);
        assert_eq!(
            (s.ep.kernel_launches, s.ep.api, s.ep.stream),
            (1, API_DRIVER, 0x5)
        );
    }

    #[test]
    fn blocking_copy_after_pending_async_closes_with_first_copy() {
        let mut s = launched(1);
        s.on_d2h_copy(200, 10, 0x9, false);
        s.on_d2h_copy(220, 99, 0, true);
        let ep = s.on_copy_return(260, 0).expect("episode");
        assert_eq!(
            (ep.copy_bytes, ep.t_copy_enqueue_ns, ep.t_copy_done_ns),
            (10, 200, 260)
        );
    }

    #[test]
    fn runtime_depth_marks_nested_driver_calls() {
        let mut s = ThreadState::default();
        assert!(!s.in_runtime());
        assert!(s.enter_runtime());
        assert!(s.in_runtime());
        assert!(!s.enter_runtime(), "nested runtime call is not outermost");
        assert!(!s.leave_runtime());
        assert!(s.leave_runtime());
        assert!(!s.in_runtime());
        assert!(!s.leave_runtime(), "unmatched return is ignored");
        assert_eq!(s.runtime_depth, 0);
    }

    #[test]
    fn the_runtimes_own_driver_launch_is_told_from_a_direct_one() {
        let key = launch_key([4, 1, 1], [256, 1, 1]);
        let mut s = ThreadState::default();
        // The runtime's own: deeper, same shape, next launch; or a tail
        // call, at the same stack pointer.
        s.note_runtime_launch(0x7000, key);
        assert!(s.take_nested_launch(0x7000, key));
        s.note_runtime_launch(0x7000, key);
        assert!(s.take_nested_launch(0x6f00, key));
        assert!(
            !s.take_nested_launch(0x6f00, key),
            "a note serves one driver launch"
        );
        // A direct launch after the runtime call failed before the driver:
        // another shape, or not deeper, or another call in between.
        s.note_runtime_launch(0x7000, key);
        assert!(!s.take_nested_launch(0x6f00, launch_key([8, 1, 1], [256, 1, 1])));
        s.note_runtime_launch(0x7000, key);
        assert!(!s.take_nested_launch(0x7100, key));
        s.note_runtime_launch(0x7000, key);
        s.settle_launch(0x7000);
        assert!(!s.take_nested_launch(0x6f00, key));
        // A probed call inside the runtime launch (deeper) keeps the note.
        s.note_runtime_launch(0x7000, key);
        s.settle_launch(0x6e00);
        assert!(s.take_nested_launch(0x6f00, key));
    }

    #[test]
    fn launch_keys_tell_shapes_apart() {
        let shapes = [
            ([1, 1, 1], [1, 1, 1]),
            ([1, 1, 1], [2, 1, 1]),
            ([2, 1, 1], [1, 1, 1]),
            ([1, 2, 1], [1, 1, 1]),
            ([1, 1, 2], [1, 1, 1]),
            ([1, 1, 1], [1, 2, 1]),
            ([1, 1, 1], [1, 1, 2]),
            ([128, 32, 1], [256, 1, 1]),
            ([256, 1, 1], [128, 32, 1]),
        ];
        for (i, (g, b)) in shapes.iter().enumerate() {
            for (h, c) in &shapes[i + 1..] {
                assert_ne!(launch_key(*g, *b), launch_key(*h, *c), "{g:?} {b:?}");
            }
        }
    }

    #[test]
    fn call_bookkeeping_dispatches_on_return() {
        let mut s = launched(1);
        s.begin_call(None, 0);
        s.on_d2h_copy(200, 8, 0x10, false);
        assert_eq!(
            s.end_call(210, 0),
            None,
            "async copy return completes nothing"
        );
        s.begin_call(Some(Completion::StreamSync), 0x20);
        assert_eq!(s.end_call(220, 0), None, "other stream");
        s.begin_call(Some(Completion::StreamSync), 0x10);
        let ep = s.end_call(230, 0).expect("episode");
        assert_eq!(ep.t_copy_done_ns, 230);
        assert_eq!(s.pending_call, 0);

        let mut s = launched(1);
        s.begin_call(Some(Completion::SyncCopy), 0);
        s.on_d2h_copy(300, 8, 0, true);
        assert_eq!(s.end_call(340, 0).map(|e| e.t_copy_done_ns), Some(340));
        assert_eq!(s.end_call(350, 0), None, "nothing pending");
    }

    #[test]
    fn completion_codes_round_trip() {
        for c in [
            Completion::SyncCopy,
            Completion::StreamSync,
            Completion::EventSync,
            Completion::DeviceSync,
            Completion::ContextSync,
        ] {
            assert_eq!(Completion::from_u32(c as u32), Some(c));
        }
        assert_eq!(Completion::from_u32(0), None);
        assert_eq!(Completion::from_u32(99), None);
    }
}
