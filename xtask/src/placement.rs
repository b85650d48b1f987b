//! Where a bench runs: the measured operations on a CPU of their own, what
//! the bench starts on the others (see `hosttax.rs`, "Placement").

use anyhow::{Result, bail};

/// Where the bench runs: the measured operations on `measured`, the rest
/// (this process and what it starts) on `rest`.
pub(crate) struct Placement {
    pub(crate) measured: usize,
    pub(crate) rest: Vec<usize>,
    /// This thread's CPUs before, restored when dropped.
    before: libc::cpu_set_t,
}

impl Placement {
    /// Takes the last CPU this process may use for the measured runs and
    /// moves this thread (so what it starts from now) onto the others; with
    /// a single CPU, both share it.
    pub(crate) fn new() -> Result<Self> {
        // SAFETY: a zeroed cpu_set_t is the empty set; the kernel fills it.
        let mut before: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: a valid set of the size passed.
        if unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut before) } != 0 {
            bail!("sched_getaffinity: {}", std::io::Error::last_os_error());
        }
        let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
            // SAFETY: in range of the set.
            .filter(|&c| unsafe { libc::CPU_ISSET(c, &before) })
            .collect();
        let Some((&measured, others)) = cpus.split_last() else {
            bail!("no CPU allowed");
        };
        let rest = if others.is_empty() {
            vec![measured]
        } else {
            others.to_vec()
        };
        set_affinity(&rest)?;
        Ok(Self {
            measured,
            rest,
            before,
        })
    }
}

impl Drop for Placement {
    fn drop(&mut self) {
        // SAFETY: the set read in `new`.
        unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &self.before) };
    }
}

fn set_affinity(cpus: &[usize]) -> Result<()> {
    // SAFETY: as in `Placement::new`.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // SAFETY: CPU numbers come from a set of this size.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: a valid set of the size passed.
    if unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) } != 0 {
        bail!("sched_setaffinity: {}", std::io::Error::last_os_error());
    }
    Ok(())
}
