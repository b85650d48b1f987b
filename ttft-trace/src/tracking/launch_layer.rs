//! Which layer each traced process's launches are probed at, as the
//! processes go: the state the CUDA launch-layer policy
//! ([`crate::probes::cuda::launch_layer`]) is applied to.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    num::NonZeroU32,
};

use ttft_trace_common::GpuCounters;

use crate::probes::{
    Probes, Reach,
    cuda::launch_layer::{self, is_runtime_launch},
    libraries::FileId,
};

#[derive(Default)]
pub(super) struct LaunchLayer {
    /// Traced processes whose launches are left to the driver's probes,
    /// and with host-wide probes, the runtime files.
    driver_launches: BTreeSet<u32>,
    driver_launch_files: HashSet<FileId>,
    /// The runtime libraries each live traced process maps, at its last
    /// scan: whose evidence speaks for a file's host-wide probes.
    runtime_files: HashMap<u32, Vec<FileId>>,
}

impl LaunchLayer {
    /// The runtime files `pid` maps, at its scan now.
    pub fn note_runtimes(&mut self, pid: u32, files: Vec<FileId>) {
        self.runtime_files.insert(pid, files);
    }

    /// Forgets the runtime files of the processes not in `live`.
    pub fn keep_live(&mut self, live: &[(u32, u32)]) {
        self.runtime_files
            .retain(|pid, _| live.iter().any(|(p, _)| p == pid));
    }

    /// Forgets a process gone from the kernel's counters.
    pub fn forget_process(&mut self, tgid: u32) {
        self.driver_launches.remove(&tgid);
    }

    /// Forgets a file whose probes were detached.
    pub fn forget_file(&mut self, id: &FileId) {
        self.driver_launch_files.remove(id);
    }

    /// Leaves the launches of the processes whose runtime showed that they
    /// all reach the driver's probes to those alone: per process where the
    /// probes are bound to each, per file where they are `host_wide`.
    pub fn choose(
        &mut self,
        probes: &mut Probes,
        reading: &BTreeMap<u32, GpuCounters>,
        host_wide: bool,
    ) {
        if host_wide {
            self.choose_per_file(probes, reading);
            return;
        }
        for tgid in launch_layer::ready(reading, &self.driver_launches) {
            let Some(pid) = NonZeroU32::new(tgid) else {
                continue;
            };
            self.driver_launches.insert(tgid);
            let dropped = probes.detach_programs(Reach::Process(pid), None, is_runtime_launch);
            if dropped > 0 {
                let c = &reading[&tgid];
                log::info!(
                    "launches of pid {tgid} are traced at the driver from now: all {} of its \
                     runtime's launches reached it ({dropped} runtime launch probes detached)",
                    c.runtime_launches
                );
            }
        }
    }

    /// Host-wide probes: a runtime file's launch probes go once the traced
    /// processes that map it show, together, that its launches reach the
    /// driver's probes ([`launch_layer::file_ready`]).
    fn choose_per_file(&mut self, probes: &mut Probes, reading: &BTreeMap<u32, GpuCounters>) {
        let files: HashSet<&FileId> = self.runtime_files.values().flatten().collect();
        let mut ready = Vec::new();
        for file in files {
            if self.driver_launch_files.contains(file) {
                continue;
            }
            let users: Vec<&GpuCounters> = self
                .runtime_files
                .iter()
                .filter(|(_, files)| files.contains(file))
                .filter_map(|(pid, _)| reading.get(pid))
                .collect();
            if launch_layer::file_ready(&users) {
                ready.push((file.clone(), users.len()));
            }
        }
        for (file, users) in ready {
            let dropped = probes.detach_programs(Reach::Host, Some(&file), is_runtime_launch);
            if dropped > 0 {
                let path = probes.attached_path(&file).map(|p| p.display().to_string());
                log::info!(
                    "launches through {} are traced at the driver from now: the {users} traced \
                     process(es) that map it showed all their runtime launches reach it \
                     ({dropped} runtime launch probes detached host-wide)",
                    path.as_deref().unwrap_or("a runtime")
                );
            }
            self.driver_launch_files.insert(file);
        }
    }
}
