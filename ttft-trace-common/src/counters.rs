//! Counters aggregated in the kernel, per traced process, so that userspace
//! does not need one event per launch or copy.

/// Direction of a memory copy, from the `cudaMemcpyKind` argument or the
/// driver function's name. The discriminants index [`GpuCounters`] arrays.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    HostToHost = 0,
    HostToDevice = 1,
    DeviceToHost = 2,
    DeviceToDevice = 3,
    /// `cudaMemcpyDefault` (direction inferred by the driver from unified
    /// addressing) and `cuMemcpyAsync`: not knowable from the arguments.
    Unknown = 4,
}

/// Number of [`Direction`] values.
pub const DIRECTIONS: usize = 5;

impl Direction {
    /// From a `cudaMemcpyKind` argument. Values outside the enum count as
    /// unknown rather than being trusted.
    pub fn from_cuda_kind(kind: u64) -> Self {
        match kind {
            0 => Self::HostToHost,
            1 => Self::HostToDevice,
            2 => Self::DeviceToHost,
            3 => Self::DeviceToDevice,
            _ => Self::Unknown,
        }
    }

    /// Label value used in metrics and logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::HostToHost => "h2h",
            Self::HostToDevice => "h2d",
            Self::DeviceToHost => "d2h",
            Self::DeviceToDevice => "d2d",
            Self::Unknown => "unknown",
        }
    }

    pub const ALL: [Direction; DIRECTIONS] = [
        Self::HostToHost,
        Self::HostToDevice,
        Self::DeviceToHost,
        Self::DeviceToDevice,
        Self::Unknown,
    ];
}

/// Per-process GPU API counters (one copy per CPU in the kernel; userspace
/// sums them).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuCounters {
    pub kernel_launches: u64,
    pub graph_launches: u64,
    pub memcpy_calls: [u64; DIRECTIONS],
    pub memcpy_bytes: [u64; DIRECTIONS],
    pub episodes: u64,
    /// Launches seen at the runtime's probes (counted in the two above).
    pub runtime_launches: u64,
    /// Of those, the ones whose own driver launch was seen at the driver's
    /// probes: when it is all of them, userspace may leave the launches to
    /// the driver's probes alone (one trap per launch).
    pub runtime_launches_at_driver: u64,
}

impl GpuCounters {
    /// Adds another CPU's (or process's) counters into this one.
    pub fn add(&mut self, other: &GpuCounters) {
        self.kernel_launches = self.kernel_launches.wrapping_add(other.kernel_launches);
        self.graph_launches = self.graph_launches.wrapping_add(other.graph_launches);
        for i in 0..DIRECTIONS {
            self.memcpy_calls[i] = self.memcpy_calls[i].wrapping_add(other.memcpy_calls[i]);
            self.memcpy_bytes[i] = self.memcpy_bytes[i].wrapping_add(other.memcpy_bytes[i]);
        }
        self.episodes = self.episodes.wrapping_add(other.episodes);
        self.runtime_launches = self.runtime_launches.wrapping_add(other.runtime_launches);
        self.runtime_launches_at_driver = self
            .runtime_launches_at_driver
            .wrapping_add(other.runtime_launches_at_driver);
    }
}

const _: () = {
    assert!(core::mem::size_of::<GpuCounters>() == 8 * (5 + 2 * DIRECTIONS));
};

/// Indexes of the global per-CPU statistics array.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stat {
    /// Events dropped because the ring buffer was full.
    RingbufLost = 0,
    /// Threads whose episode state could not be stored (map full).
    ThreadStateFull = 1,
    /// Forked children that could not be added to `TRACKED` (full): they
    /// and their descendants are not traced.
    TrackedFull = 2,
    /// (namespace, port) pairs that could not be added to `LISTEN_NETNS`
    /// (full): connections accepted on them are not followed.
    ListenNetnsFull = 3,
    /// Followed connections whose first bytes were read before any of
    /// their segments was seen: the data came with the handshake (a lost
    /// final ACK, TCP Fast Open), which no segment hook sees, or the
    /// segment program does not run where their socket lives.
    SegmentsUnseen = 4,
    /// Of those, the ones whose listening port's handshakes were never
    /// seen at a cgroup's ingress either: their listening socket lives
    /// outside the cgroups the program is on (systemd socket activation
    /// creates it in its own).
    ListenerUnseen = 5,
    /// Forked children (threads or processes) not added to `TRACKED`
    /// because their workload's tenant holds its share of it
    /// ([`QUOTA_THREADS`] in `OVER_SHARE`).
    TrackedQuota = 6,
    /// HTTP/2 frames walked but not reported: their event refused by a
    /// full ring buffer (a call with more than `H2_MAX_FRAMES` sends several).
    H2FramesDropped = 7,
    /// Times an HTTP/2 connection's frame walk lost its place in one
    /// direction (a frame header split across calls, an implausible
    /// header, a segment out of order): its frames go unread until a call
    /// starts on a plausible header again.
    H2WalkLost = 8,
    /// Plaintext a traced process's `SSL_write` encrypted without sending
    /// any of it on a followed connection in the call (a memory BIO, whose
    /// records the process sends later; or a connection not followed):
    /// counted, never bound to a connection by guess.
    TlsUnbound = 9,
    /// `SSL_write` calls whose records went to a memory BIO, held in
    /// `TLS_RECORDS` for the TCP send that carries them later.
    TlsHeld = 10,
    /// Of those, the calls whose first record a TCP send on a followed
    /// connection was seen to carry (matched by its ciphertext): the
    /// difference is plaintext never bound (a record evicted, sent on a
    /// connection not followed, or split so that its head was not found).
    TlsHeldSent = 11,
}

/// Number of [`Stat`] slots.
pub const STATS: u32 = 12;

/// Bits of an `OVER_SHARE` value (workload id -> bits): its tenant holds
/// its share of followed listeners; of `TRACKED` entries. Set by userspace
/// at each scan; the kernel refuses that workload's `listen()` pairs, and
/// its forked children, while set.
pub const QUOTA_LISTENERS: u32 = 1;
pub const QUOTA_THREADS: u32 = 2;

/// The plain (not LRU) hash maps, which refuse inserts when full, and the
/// statistic counting the refusals in the kernel, for
/// `ttft_trace_map_full_total{map}`.
pub const MAP_FULL_STATS: [(Stat, &str); 2] = [
    (Stat::TrackedFull, "TRACKED"),
    (Stat::ListenNetnsFull, "LISTEN_NETNS"),
];
