//! The cgroup v2 hierarchy for the benches: where it is mounted, cgroups
//! of their own (the traced workload's, as a container's or a systemd
//! unit's would be; an empty one for a program that must run for no
//! socket), and links of a program to a cgroup.

use std::{
    fs::File,
    os::fd::{AsRawFd as _, OwnedFd},
    path::PathBuf,
    thread,
    time::Duration,
};

use anyhow::{Context as _, Result};

use crate::rawfloor::{ATTR_SIZE, bpf, put};

const BPF_LINK_CREATE: libc::c_long = 28;
/// `enum bpf_attach_type`: a `cgroup_skb` program on received packets.
pub const BPF_CGROUP_INET_INGRESS: u32 = 0;

/// The mount point of the cgroup v2 hierarchy (`/sys/fs/cgroup`, or
/// `/sys/fs/cgroup/unified` on a hybrid host), from `/proc/self/mountinfo`.
pub fn root_in(mountinfo: &str) -> Option<&str> {
    mountinfo.lines().find_map(|line| {
        let (fields, fs) = line.split_once(" - ")?;
        (fs.split(' ').next()? == "cgroup2").then(|| fields.split(' ').nth(4))?
    })
}

/// This host's cgroup v2 mount, if any.
pub fn root() -> Result<Option<PathBuf>> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(root_in(&mountinfo).map(PathBuf::from))
}

/// A cgroup of the bench's own, right under the root; removed on drop
/// (once its processes are gone).
pub struct BenchCgroup {
    dir: PathBuf,
    file: File,
}

impl BenchCgroup {
    pub fn new(name: &str) -> Result<Self> {
        let root = root()?.context("no cgroup v2 hierarchy is mounted")?;
        let dir = root.join(name);
        match std::fs::create_dir(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                return Err(e).with_context(|| format!("creating {}", dir.display()));
            }
            _ => {}
        }
        let file = File::open(&dir).with_context(|| dir.display().to_string())?;
        Ok(Self { dir, file })
    }

    /// A command that runs `program` in this cgroup from its start (a
    /// shell joins it, then execs the program): the sockets it makes, a
    /// listener and so its connections, are the cgroup's. Arguments follow
    /// with `arg`.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> std::process::Command {
        let mut c = std::process::Command::new("sh");
        c.args(["-c", r#"echo $$ > "$0" && exec "$@""#])
            .arg(self.procs())
            .arg(program);
        c
    }

    /// Moves process `pid` (all its threads) in.
    pub fn add(&self, pid: u32) -> Result<()> {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string())
            .with_context(|| format!("moving pid {pid} into {}", self.dir.display()))
    }

    /// Its `cgroup.procs`: a process that writes `0` (or its pid) there
    /// moves in, before it makes sockets (a socket belongs to the cgroup
    /// of the process that made it).
    pub fn procs(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    /// The path as `/proc/PID/cgroup` shows it.
    pub fn path(&self) -> String {
        format!(
            "/{}",
            self.dir.file_name().unwrap_or_default().to_string_lossy()
        )
    }

    pub fn file(&self) -> &File {
        &self.file
    }
}

impl Drop for BenchCgroup {
    fn drop(&mut self) {
        // A process killed just before may take a moment to leave.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            thread::sleep(Duration::from_millis(20));
        }
        eprintln!("bench: could not remove {}", self.dir.display());
    }
}

/// Attaches `prog` to `cgroup` as `attach_type` with a link (gone when the
/// link's fd is closed).
pub fn link(prog: &OwnedFd, cgroup: &File, attach_type: u32) -> Result<OwnedFd> {
    let mut attr = [0u8; ATTR_SIZE];
    put(&mut attr, 0, &(prog.as_raw_fd() as u32).to_ne_bytes());
    put(&mut attr, 4, &(cgroup.as_raw_fd() as u32).to_ne_bytes());
    put(&mut attr, 8, &attach_type.to_ne_bytes());
    bpf(BPF_LINK_CREATE, &attr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_mount_on_pure_and_hybrid_hosts() {
        let hybrid = "35 25 0:30 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n\
                      36 35 0:31 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw\n\
                      37 35 0:32 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n";
        assert_eq!(root_in(hybrid), Some("/sys/fs/cgroup/unified"));
        let pure = "30 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw\n";
        assert_eq!(root_in(pure), Some("/sys/fs/cgroup"));
        assert_eq!(
            root_in("37 35 0:32 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"),
            None
        );
    }
}
