//! The kernel maps as the session sees them: the tracked processes and
//! their workloads, listening ports, per-process counters and scheduler
//! totals, exited processes, statistics and the ring buffer.

use std::collections::BTreeMap;

use aya::{
    Ebpf,
    maps::{HashMap as BpfHashMap, MapData, PerCpuArray, PerCpuHashMap, RingBuf},
};
use ttft_trace_common::signals::{RUNQ_BUCKETS, RUNQ_SUM_SLOT, SchedTotals};
use ttft_trace_common::{
    GpuCounters, LISTEN_ANY_NETNS, LISTEN_SOME_NETNS, ListenKey, MAP_FULL_STATS, Stat, listen_byte,
};

use super::{ProbeError, Probes};

impl Probes {
    /// Starts tracing a process as part of `workload` (the root's tgid);
    /// its children are added by the kernel, in the same workload. A full
    /// map is counted and warned about, not an error: the process is then
    /// not traced, everything else is. Returns whether it is tracked.
    pub fn track(&mut self, pid: u32, workload: u32) -> Result<bool, ProbeError> {
        // Marked first: the per-event programs look it up only when marked
        // (a mark left by a refused insert costs a lookup, and the exit
        // program clears it).
        self.traced_ids.set(pid);
        let mut map: BpfHashMap<_, u32, u32> = BpfHashMap::try_from(
            self.ebpf
                .map_mut("TRACKED")
                .ok_or(ProbeError::Missing("TRACKED"))?,
        )
        .map_err(|e| ProbeError::Map("TRACKED", e))?;
        let result = map.insert(pid, workload, 0);
        self.full_unless_stored("TRACKED", result, || format!("process {pid}"))
    }

    /// Counts an insert refused because its map is full (E2BIG; ENOMEM for
    /// maps allocated as they fill), with a warning; other errors are errors.
    /// Returns whether it was stored.
    fn full_unless_stored(
        &mut self,
        name: &'static str,
        result: Result<(), aya::maps::MapError>,
        what: impl FnOnce() -> String,
    ) -> Result<bool, ProbeError> {
        match result {
            Ok(()) => Ok(true),
            Err(aya::maps::MapError::SyscallError(e))
                if matches!(e.io_error.raw_os_error(), Some(libc::E2BIG | libc::ENOMEM)) =>
            {
                let refused = self.map_full.entry(name).or_default();
                *refused += 1;
                // A refused process is tried again at every scan: the first
                // hundred are said, then every thousandth.
                if *refused <= 100 || refused.is_multiple_of(1000) {
                    log::warn!(
                        "eBPF map {name} is full: {} not stored ({} refused so far)",
                        what(),
                        refused
                    );
                }
                Ok(false)
            }
            Err(e) => Err(ProbeError::Map(name, e)),
        }
    }

    /// Inserts refused because the map was full, by map, since the start:
    /// in the kernel (the [`MAP_FULL_STATS`]) and from here.
    pub fn map_full(&self) -> Result<Vec<(&'static str, u64)>, ProbeError> {
        MAP_FULL_STATS
            .iter()
            .map(|&(stat, name)| {
                let here = self.map_full.get(name).copied().unwrap_or(0);
                Ok((name, self.stat(stat)?.wrapping_add(here)))
            })
            .collect()
    }

    /// Lets the kernel announce `tgid` again (its pid may be reused).
    pub fn forget_announced(&mut self, tgid: u32) -> Result<(), ProbeError> {
        remove_key::<u64>(&mut self.ebpf, "ANNOUNCED", tgid)
    }

    /// The processes the kernel announced (and userspace has not forgotten).
    pub fn announced(&self) -> Result<Vec<u32>, ProbeError> {
        self.process_keys::<u64>("ANNOUNCED")
    }

    /// The process ids a hash map keyed by them holds now.
    fn process_keys<V: aya::Pod>(&self, name: &'static str) -> Result<Vec<u32>, ProbeError> {
        let map: BpfHashMap<_, u32, V> =
            BpfHashMap::try_from(self.ebpf.map(name).ok_or(ProbeError::Missing(name))?)
                .map_err(|e| ProbeError::Map(name, e))?;
        Ok(map.keys().filter_map(Result::ok).collect())
    }

    /// Marks a TCP port as a listening port of the traced tree, in network
    /// namespace `netns` (every namespace: None, or where the probes cannot
    /// read a socket's): connections accepted on it are followed as server
    /// connections. A full `LISTEN_NETNS` is counted and warned about;
    /// returns whether the port is followed.
    pub fn add_listen_port(&mut self, netns: Option<u32>, port: u16) -> Result<bool, ProbeError> {
        let which = match netns.filter(|_| self.netns_known) {
            Some(netns) => {
                let mut map: BpfHashMap<_, ListenKey, u32> = BpfHashMap::try_from(
                    self.ebpf
                        .map_mut("LISTEN_NETNS")
                        .ok_or(ProbeError::Missing("LISTEN_NETNS"))?,
                )
                .map_err(|e| ProbeError::Map("LISTEN_NETNS", e))?;
                let key = ListenKey {
                    netns,
                    port,
                    _pad: 0,
                };
                let result = map.insert(key, 1, 0);
                let what = || format!("port {port} in network namespace {netns}");
                if !self.full_unless_stored("LISTEN_NETNS", result, what)? {
                    return Ok(false);
                }
                LISTEN_SOME_NETNS
            }
            None => LISTEN_ANY_NETNS,
        };
        self.listen_ports.set(listen_byte(port, which));
        Ok(true)
    }

    /// The (network namespace, port) pairs `LISTEN_NETNS` holds: those
    /// userspace added and those the kernel added at a traced `listen()`.
    pub fn listen_netns_pairs(&self) -> Result<Vec<(u32, u16)>, ProbeError> {
        let name = "LISTEN_NETNS";
        let map: BpfHashMap<_, ListenKey, u32> =
            BpfHashMap::try_from(self.ebpf.map(name).ok_or(ProbeError::Missing(name))?)
                .map_err(|e| ProbeError::Map(name, e))?;
        Ok(map
            .keys()
            .filter_map(Result::ok)
            .map(|k| (k.netns, k.port))
            .collect())
    }

    /// Stops following `port` in namespace `netns` (its listener closed,
    /// or its namespace is gone). `port_elsewhere`: another namespace
    /// still follows the port, which then keeps its `LISTEN_PORTS` mark.
    pub fn remove_listen_pair(
        &mut self,
        netns: u32,
        port: u16,
        port_elsewhere: bool,
    ) -> Result<(), ProbeError> {
        let name = "LISTEN_NETNS";
        let map = self.ebpf.map_mut(name).ok_or(ProbeError::Missing(name))?;
        let key = ListenKey {
            netns,
            port,
            _pad: 0,
        };
        match BpfHashMap::<_, ListenKey, u32>::try_from(map).and_then(|mut m| m.remove(&key)) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(ProbeError::Map(name, e)),
        }
        if !port_elsewhere {
            self.listen_ports
                .clear(listen_byte(port, LISTEN_SOME_NETNS));
        }
        Ok(())
    }

    /// Sets workload `workload`'s `QUOTA_*` bits in `OVER_SHARE` (none:
    /// removes it). The map is sized as `TRACKED`: every workload fits.
    pub fn set_over_share(&mut self, workload: u32, bits: u32) -> Result<(), ProbeError> {
        let name = "OVER_SHARE";
        if bits == 0 {
            return remove_key::<u32>(&mut self.ebpf, name, workload);
        }
        let mut map: BpfHashMap<_, u32, u32> =
            BpfHashMap::try_from(self.ebpf.map_mut(name).ok_or(ProbeError::Missing(name))?)
                .map_err(|e| ProbeError::Map(name, e))?;
        let result = map.insert(workload, bits, 0);
        self.full_unless_stored(name, result, || format!("workload {workload}"))
            .map(|_| ())
    }

    /// Stops tracing an id (a process that exited, or a thread's id).
    pub fn untrack(&mut self, pid: u32) -> Result<(), ProbeError> {
        remove_key::<u32>(&mut self.ebpf, "TRACKED", pid)
    }

    /// Ids in the tracked map (processes and, transiently, threads), each
    /// with its workload id.
    pub fn tracked(&self) -> Result<Vec<(u32, u32)>, ProbeError> {
        let map: BpfHashMap<_, u32, u32> = BpfHashMap::try_from(
            self.ebpf
                .map("TRACKED")
                .ok_or(ProbeError::Missing("TRACKED"))?,
        )
        .map_err(|e| ProbeError::Map("TRACKED", e))?;
        Ok(map.iter().filter_map(Result::ok).collect())
    }

    /// The workload of a tracked id, if it is tracked now.
    pub fn tracked_workload(&self, id: u32) -> Result<Option<u32>, ProbeError> {
        self.lookup_workload("TRACKED", id)
    }

    /// The workload an event's process belongs to: tracked now, or a traced
    /// process that has exited (its last events may still be in the ring
    /// buffer when its exit removed it from TRACKED).
    pub fn workload_of(&self, id: u32) -> Result<Option<u32>, ProbeError> {
        match self.lookup_workload("TRACKED", id)? {
            Some(w) => Ok(Some(w)),
            None => self.lookup_workload("EXITED", id),
        }
    }

    fn lookup_workload(&self, name: &'static str, id: u32) -> Result<Option<u32>, ProbeError> {
        let map: BpfHashMap<_, u32, u32> =
            BpfHashMap::try_from(self.ebpf.map(name).ok_or(ProbeError::Missing(name))?)
                .map_err(|e| ProbeError::Map(name, e))?;
        match map.get(&id, 0) {
            Ok(w) => Ok(Some(w)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(ProbeError::Map(name, e)),
        }
    }

    /// Per-process counters, summed over CPUs.
    pub fn counters(&self) -> Result<BTreeMap<u32, GpuCounters>, ProbeError> {
        self.per_process("COUNTERS", GpuCounters::add)
    }

    /// Reads a per-CPU map keyed by tgid, summing each value over CPUs.
    fn per_process<V: aya::Pod + Default>(
        &self,
        name: &'static str,
        add: fn(&mut V, &V),
    ) -> Result<BTreeMap<u32, V>, ProbeError> {
        let map: PerCpuHashMap<_, u32, V> =
            PerCpuHashMap::try_from(self.ebpf.map(name).ok_or(ProbeError::Missing(name))?)
                .map_err(|e| ProbeError::Map(name, e))?;
        let mut out = BTreeMap::new();
        for entry in map.iter() {
            let (tgid, per_cpu) = entry.map_err(|e| ProbeError::Map(name, e))?;
            let mut sum = V::default();
            for c in per_cpu.iter() {
                add(&mut sum, c);
            }
            out.insert(tgid, sum);
        }
        Ok(out)
    }

    /// Forgets a process's counters once they have been read for the last time.
    pub fn drop_counters(&mut self, tgid: u32) -> Result<(), ProbeError> {
        self.drop_per_cpu::<GpuCounters>("COUNTERS", tgid)
    }

    /// Forgets a process's scheduler totals once they have been read for
    /// the last time.
    pub fn drop_sched_totals(&mut self, tgid: u32) -> Result<(), ProbeError> {
        self.drop_per_cpu::<SchedTotals>("SCHED_TOTALS", tgid)
    }

    fn drop_per_cpu<V: aya::Pod>(
        &mut self,
        name: &'static str,
        tgid: u32,
    ) -> Result<(), ProbeError> {
        let mut map: PerCpuHashMap<_, u32, V> =
            PerCpuHashMap::try_from(self.ebpf.map_mut(name).ok_or(ProbeError::Missing(name))?)
                .map_err(|e| ProbeError::Map(name, e))?;
        match map.remove(&tgid) {
            // An LRU map may have evicted it already.
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
            {
                Ok(())
            }
            Err(e) => Err(ProbeError::Map(name, e)),
        }
    }

    /// Exited processes whose workload the kernel still keeps (EXITED),
    /// for events read after their exit.
    pub fn exited(&self) -> Result<Vec<u32>, ProbeError> {
        self.process_keys::<u32>("EXITED")
    }

    /// Forgets an exited process's workload, its last events read.
    pub fn forget_exited(&mut self, tgid: u32) -> Result<(), ProbeError> {
        remove_key::<u32>(&mut self.ebpf, "EXITED", tgid)
    }

    /// Per-process scheduler totals, summed over CPUs.
    pub fn sched_totals(&self) -> Result<BTreeMap<u32, SchedTotals>, ProbeError> {
        self.per_process("SCHED_TOTALS", SchedTotals::add)
    }

    /// The run-queue delay histogram (bucket counts, sum in ns), summed over CPUs.
    pub fn runq_histogram(&self) -> Result<(Vec<u64>, u64), ProbeError> {
        let map: PerCpuArray<_, u64> = PerCpuArray::try_from(
            self.ebpf
                .map("RUNQ_HIST")
                .ok_or(ProbeError::Missing("RUNQ_HIST"))?,
        )
        .map_err(|e| ProbeError::Map("RUNQ_HIST", e))?;
        let slot = |i: u32| -> Result<u64, ProbeError> {
            let v = map
                .get(&i, 0)
                .map_err(|e| ProbeError::Map("RUNQ_HIST", e))?;
            Ok(v.iter().copied().fold(0u64, u64::wrapping_add))
        };
        let buckets = (0..RUNQ_BUCKETS).map(slot).collect::<Result<Vec<_>, _>>()?;
        Ok((buckets, slot(RUNQ_SUM_SLOT)?))
    }

    /// A kernel statistic, summed over CPUs.
    /// Whether process `pid` showed a memory BIO (an `SSL_write` that
    /// neither sent nor held: `TLS_MEMORY_BIO`); false where the map cannot
    /// be read.
    pub fn memory_bio_seen(&self, pid: u32) -> bool {
        self.ebpf
            .map("TLS_MEMORY_BIO")
            .and_then(|m| BpfHashMap::<_, u32, u32>::try_from(m).ok())
            .is_some_and(|m| m.get(&pid, 0).is_ok())
    }

    pub fn stat(&self, stat: Stat) -> Result<u64, ProbeError> {
        let map: PerCpuArray<_, u64> = PerCpuArray::try_from(
            self.ebpf
                .map("STATS_MAP")
                .ok_or(ProbeError::Missing("STATS_MAP"))?,
        )
        .map_err(|e| ProbeError::Map("STATS_MAP", e))?;
        let values = map
            .get(&(stat as u32), 0)
            .map_err(|e| ProbeError::Map("STATS_MAP", e))?;
        Ok(values.iter().copied().fold(0u64, u64::wrapping_add))
    }

    /// Takes the ring buffer out, for the event loop to own.
    pub fn take_events(&mut self) -> Result<RingBuf<MapData>, ProbeError> {
        let map = self
            .ebpf
            .take_map("EVENTS")
            .ok_or(ProbeError::Missing("EVENTS"))?;
        RingBuf::try_from(map).map_err(|e| ProbeError::Map("EVENTS", e))
    }
}

/// Removes a key from a hash map keyed by tgid; a missing key is fine.
fn remove_key<V: aya::Pod>(
    ebpf: &mut Ebpf,
    name: &'static str,
    key: u32,
) -> Result<(), ProbeError> {
    let map = ebpf.map_mut(name).ok_or(ProbeError::Missing(name))?;
    match BpfHashMap::<_, u32, V>::try_from(map).and_then(|mut m| m.remove(&key)) {
        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        Err(aya::maps::MapError::SyscallError(e))
            if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
        {
            Ok(())
        }
        Err(e) => Err(ProbeError::Map(name, e)),
    }
}
