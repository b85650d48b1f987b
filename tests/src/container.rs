//! Containers made by a test, without a container runtime: a process in a
//! mount namespace of its own, with a directory tree as its root (`pivot_root`) the test
//! writes (the host's `/usr` and the fixtures bind-mounted in, so the
//! fixture workloads run unchanged), and placed in a cgroup named as the
//! kubelet names them (`kubepods/pod<uid>/<container id>` with the cgroupfs
//! driver, `kubepods.slice/.../kubepods-besteffort-pod<uid_>.slice/...`
//! with the systemd driver). Root only.
//!
//! The mounts are made in the child's own namespace, after it made every
//! mount private: the host sees none of them, and the tree is removed
//! when the container is dropped.

use std::{
    ffi::CString,
    fs,
    os::unix::{ffi::OsStrExt, fs::symlink, process::CommandExt},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::atomic::{AtomicU64, Ordering},
};

use anyhow::{Context as _, Result, bail};

use crate::fixtures::{self, ChildGuard, Workload};

/// How a directory of the host appears inside the container.
#[derive(Debug, Clone)]
pub enum View {
    /// A bind mount: the same files, the same device.
    Bind,
    /// A read-only overlay whose only layer is the host directory: the same
    /// files under another device number, as a container image shows them.
    Overlay,
}

/// One mount made inside the container's namespace.
#[derive(Debug, Clone)]
struct Mount {
    source: PathBuf,
    /// Path inside the container.
    target: PathBuf,
    view: View,
}

/// A container's root directory, being written by the test.
#[derive(Debug)]
pub struct ContainerRoot {
    pub dir: PathBuf,
    mounts: Vec<Mount>,
    /// An empty directory, the second (empty) layer of overlay views.
    empty: PathBuf,
    /// Variables the workload is started with (after the downward-API
    /// ones are cleared): what a pod spec would set.
    env: Vec<(String, String)>,
}

impl ContainerRoot {
    /// A new root with the host's `/usr` (and the merged-usr links), and the
    /// fixture directory at its own path, shown as `fixtures_view`.
    pub fn new(name: &str, fixtures_view: View) -> Result<Self> {
        let dir = fixtures::temp_path(&format!("container-{name}"), "root");
        let empty = fixtures::temp_path(&format!("container-{name}"), "empty");
        fs::create_dir_all(&dir)?;
        fs::create_dir_all(&empty)?;
        for link in ["lib", "lib64", "bin", "sbin"] {
            if Path::new("/").join(link).is_symlink() {
                symlink(format!("usr/{link}"), dir.join(link))?;
            }
        }
        let mut root = Self {
            dir,
            mounts: Vec::new(),
            empty,
            env: Vec::new(),
        };
        root.mount(Path::new("/usr"), Path::new("/usr"), View::Bind)?;
        // The loader finds `$ORIGIN` of the program through /proc/self/exe.
        root.mount(Path::new("/proc"), Path::new("/proc"), View::Bind)?;
        let fixtures = fixtures::fixture_dir();
        root.mount(&fixtures, &fixtures, fixtures_view)?;
        Ok(root)
    }

    /// Starts the workload with `key=value` in its environment (a forged
    /// `POD_NAME`, say).
    pub fn env(&mut self, key: &str, value: &str) {
        self.env.push((key.into(), value.into()));
    }

    /// The host path of `inside` (an absolute path in the container).
    pub fn path(&self, inside: &str) -> PathBuf {
        self.dir.join(inside.trim_start_matches('/'))
    }

    /// Writes a file inside the container.
    pub fn write(&self, inside: &str, content: impl AsRef<[u8]>) -> Result<PathBuf> {
        let p = self.path(inside);
        fs::create_dir_all(p.parent().context("no parent")?)?;
        fs::write(&p, content)?;
        Ok(p)
    }

    /// A symlink inside the container, pointing at `target` (not resolved).
    pub fn symlink(&self, target: &str, inside: &str) -> Result<()> {
        let p = self.path(inside);
        fs::create_dir_all(p.parent().context("no parent")?)?;
        symlink(target, &p)?;
        Ok(())
    }

    /// A FIFO inside the container.
    pub fn fifo(&self, inside: &str) -> Result<()> {
        let p = self.path(inside);
        fs::create_dir_all(p.parent().context("no parent")?)?;
        let c = CString::new(p.as_os_str().as_bytes())?;
        // SAFETY: a NUL-terminated path.
        if unsafe { libc::mkfifo(c.as_ptr(), 0o644) } != 0 {
            bail!(
                "mkfifo {}: {}",
                p.display(),
                std::io::Error::last_os_error()
            );
        }
        Ok(())
    }

    /// Mounts `source` (a host path) at `inside` in the container's
    /// namespace when it starts. A file source is bind-mounted over a file.
    pub fn mount(&mut self, source: &Path, inside: &Path, view: View) -> Result<()> {
        let target = self.path(&inside.to_string_lossy());
        if source.is_dir() {
            fs::create_dir_all(&target)?;
        } else {
            fs::create_dir_all(target.parent().context("no parent")?)?;
            fs::write(&target, "")?;
        }
        self.mounts.push(Mount {
            source: source.to_path_buf(),
            target: inside.to_path_buf(),
            view,
        });
        Ok(())
    }

    /// Starts `workload` in this root and in `cgroup`, environment cleared
    /// of the downward-API variables. Its paths (binary, truth file) are
    /// paths inside the container.
    pub fn spawn(self, workload: &Workload, cgroup: PodCgroup) -> Result<Container> {
        let cstr = |p: &Path| CString::new(p.as_os_str().as_bytes());
        let root_c = cstr(&self.dir)?;
        let procs_c = cstr(&cgroup.dir.join("cgroup.procs"))?;
        let mut mounts_c = Vec::new();
        for m in &self.mounts {
            let target = cstr(&self.path(&m.target.to_string_lossy()))?;
            let (source, fstype, options) = match m.view {
                View::Bind => (cstr(&m.source)?, None, None),
                View::Overlay => (
                    CString::new("overlay")?,
                    Some(CString::new("overlay")?),
                    Some(CString::new(format!(
                        "lowerdir={}:{}",
                        m.source.display(),
                        self.empty.display()
                    ))?),
                ),
            };
            mounts_c.push((source, target, fstype, options));
        }
        let mut c = Command::new(workload.binary());
        c.args(workload.to_args())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .env_remove("LD_LIBRARY_PATH")
            .env_remove("LD_PRELOAD")
            .env_remove("POD_NAME")
            .env_remove("POD_NAMESPACE")
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        // SAFETY: only async-signal-safe calls on data prepared above.
        unsafe {
            c.pre_exec(move || enter(&root_c, &procs_c, &mounts_c));
        }
        let child = ChildGuard::new(c.spawn().context("starting the container")?);
        Ok(Container {
            pid: child.id(),
            child,
            cgroup,
            root: self,
        })
    }
}

type MountC = (CString, CString, Option<CString>, Option<CString>);

/// In a child, before exec: joins the cgroup whose `cgroup.procs` file is
/// `procs` (so that the sockets it creates are that cgroup's).
fn join_cgroup(procs: &CString) -> std::io::Result<()> {
    // SAFETY: plain syscalls on a NUL-terminated string that outlives them.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // "0": the writing process itself.
        let written = libc::write(fd, b"0".as_ptr().cast(), 1);
        libc::close(fd);
        if written != 1 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// In the child, before exec: join the cgroup, a mount namespace of its
/// own with private mounts, make the mounts, pivot into the root. Any failure fails the
/// spawn.
fn enter(root: &CString, procs: &CString, mounts: &[MountC]) -> std::io::Result<()> {
    let check = |rc: libc::c_int| {
        if rc < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    };
    join_cgroup(procs)?;
    // SAFETY: plain syscalls on NUL-terminated strings that outlive them.
    unsafe {
        check(libc::unshare(libc::CLONE_NEWNS))?;
        check(libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ))?;
        // The root becomes a mount of its own, so that the container's
        // paths (in /proc/PID/maps too) are relative to it, as under a
        // container runtime; chroot alone would show the host's paths.
        check(libc::mount(
            root.as_ptr(),
            root.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND | libc::MS_REC,
            std::ptr::null(),
        ))?;
        for (source, target, fstype, options) in mounts {
            let flags = if fstype.is_some() {
                libc::MS_RDONLY
            } else {
                libc::MS_BIND | libc::MS_REC
            };
            check(libc::mount(
                source.as_ptr(),
                target.as_ptr(),
                fstype.as_ref().map_or(std::ptr::null(), |f| f.as_ptr()),
                flags,
                options
                    .as_ref()
                    .map_or(std::ptr::null(), |o| o.as_ptr().cast()),
            ))?;
        }
        // pivot_root(".", ".") then detaching the old root (as runc does):
        // the host's tree is gone from this namespace.
        check(libc::chdir(root.as_ptr()))?;
        check(libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) as libc::c_int)?;
        check(libc::umount2(c".".as_ptr(), libc::MNT_DETACH))?;
        check(libc::chdir(c"/".as_ptr()))?;
    }
    Ok(())
}

/// A running container; killed, and its tree and cgroup removed, on drop.
pub struct Container {
    pub pid: u32,
    child: ChildGuard,
    pub cgroup: PodCgroup,
    pub root: ContainerRoot,
}

impl Container {
    /// Waits for the workload to end, up to `timeout`.
    pub fn wait(&mut self, timeout: std::time::Duration) -> Result<std::process::ExitStatus> {
        self.child.wait_timeout(timeout)
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        if let Some(c) = self.child.child_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // The mounts lived in the child's namespace only: here every mount
        // point is an empty directory. Refuse to remove a tree that shows
        // otherwise (never delete through a mount).
        let shows_mount = self.root.mounts.iter().any(|m| {
            let p = self.root.path(&m.target.to_string_lossy());
            fs::read_dir(&p).is_ok_and(|mut d| d.next().is_some())
                || fs::metadata(&p).is_ok_and(|md| md.len() > 0 && md.is_file())
        });
        if shows_mount {
            eprintln!(
                "not removing {}: a mount point is not empty",
                self.root.dir.display()
            );
            return;
        }
        let _ = fs::remove_dir_all(&self.root.dir);
        let _ = fs::remove_dir(&self.root.empty);
    }
}

/// A pod's container cgroup in the cgroup v2 hierarchy, named as the
/// kubelet and the runtime name it, removed on drop (once its processes
/// are gone) with the directories made for it.
#[derive(Debug)]
pub struct PodCgroup {
    pub dir: PathBuf,
    pub pod_uid: String,
    pub container_id: String,
    /// Directories above `dir` this made, innermost first.
    made: Vec<PathBuf>,
}

impl PodCgroup {
    /// A new, unique one, cgroupfs driver, guaranteed QoS:
    /// `kubepods/pod<uid>/<64-hex id>`.
    pub fn new() -> Result<Self> {
        let (pod_uid, container_id) = Self::ids();
        let kubepods = cgroup2_root()?.join("kubepods");
        let pod = kubepods.join(format!("pod{pod_uid}"));
        Self::make(
            pod.join(&container_id),
            vec![pod, kubepods],
            pod_uid,
            container_id,
        )
    }

    /// A new, unique one, cgroupfs driver, best-effort QoS:
    /// `kubepods/besteffort/pod<uid>/<64-hex id>`.
    pub fn besteffort() -> Result<Self> {
        let (pod_uid, container_id) = Self::ids();
        let kubepods = cgroup2_root()?.join("kubepods");
        let qos = kubepods.join("besteffort");
        let pod = qos.join(format!("pod{pod_uid}"));
        Self::make(
            pod.join(&container_id),
            vec![pod, qos, kubepods],
            pod_uid,
            container_id,
        )
    }

    /// A new, unique one, systemd driver, best-effort QoS:
    /// `kubepods.slice/kubepods-besteffort.slice/
    /// kubepods-besteffort-pod<uid, `-` as `_`>.slice/cri-containerd-<id>.scope`.
    pub fn systemd() -> Result<Self> {
        let (pod_uid, container_id) = Self::ids();
        let kubepods = cgroup2_root()?.join("kubepods.slice");
        let qos = kubepods.join("kubepods-besteffort.slice");
        let pod = qos.join(format!(
            "kubepods-besteffort-pod{}.slice",
            pod_uid.replace('-', "_")
        ));
        let dir = pod.join(format!("cri-containerd-{container_id}.scope"));
        Self::make(dir, vec![pod, qos, kubepods], pod_uid, container_id)
    }

    /// Another container of the same pod (its own cgroup beside this one).
    pub fn sibling(&self) -> Result<Self> {
        let pod = self.dir.parent().context("a pod directory")?;
        let (_, container_id) = Self::ids();
        let name = self
            .dir
            .file_name()
            .and_then(|n| n.to_str())
            .context("a container directory")?
            .replace(&self.container_id, &container_id);
        Self::make(
            pod.join(name),
            self.made.clone(),
            self.pod_uid.clone(),
            container_id,
        )
    }

    /// A unique pod UID (RFC 4122 form) and container id (64 hex digits).
    fn ids() -> (String, String) {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let salt = u64::from(std::process::id()) << 20 | n;
        let pod_uid = format!(
            "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            salt as u32,
            (salt >> 32) as u16,
            n & 0xfff,
            n & 0xfff,
            fixtures::monotonic_ns() & 0xffff_ffff_ffff
        );
        // Unique in its first 12 digits (the `container` label): this
        // process's count, then its pid.
        let container_id = format!(
            "{:06x}{:010x}{:016x}{:016x}{:016x}",
            n & 0xff_ffff,
            (salt >> 16) & 0xff_ffff_ffff,
            fixtures::monotonic_ns(),
            n,
            0xc0ffee_u64
        );
        (pod_uid, container_id)
    }

    fn make(
        dir: PathBuf,
        made: Vec<PathBuf>,
        pod_uid: String,
        container_id: String,
    ) -> Result<Self> {
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self {
            dir,
            pod_uid,
            container_id,
            made,
        })
    }
}

impl PodCgroup {
    /// Makes the process `cmd` starts join this cgroup before it runs.
    pub fn place(&self, cmd: &mut Command) -> Result<()> {
        let procs = CString::new(self.dir.join("cgroup.procs").as_os_str().as_bytes())?;
        // SAFETY: only async-signal-safe calls on data prepared here.
        unsafe {
            cmd.pre_exec(move || join_cgroup(&procs));
        }
        Ok(())
    }

    /// Moves running process `pid` (all its threads) into this cgroup.
    pub fn adopt(&self, pid: u32) -> Result<()> {
        fs::write(self.dir.join("cgroup.procs"), pid.to_string())
            .with_context(|| format!("moving pid {pid} into {}", self.dir.display()))
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        // Processes killed a moment ago may still be exiting (the kernel
        // refuses with EBUSY until they are gone): a second at most.
        for _ in 0..50 {
            match fs::remove_dir(&self.dir) {
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                _ => break,
            }
        }
        // A parent another test's pod still uses stays (not empty).
        for d in &self.made {
            let _ = fs::remove_dir(d);
        }
    }
}

/// A kubelet's pod log directory made by the test (`<namespace>_<pod>_<uid>`
/// entries, as the kubelet names them), for the daemon's `--pod-log-dir`;
/// removed on drop.
#[derive(Debug)]
pub struct PodLogDir {
    pub dir: PathBuf,
}

impl PodLogDir {
    pub fn new() -> Result<Self> {
        let dir = fixtures::temp_path("pod-logs", "d");
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self { dir })
    }

    /// Records pod `uid` as `namespace`/`pod`.
    pub fn add(&self, namespace: &str, pod: &str, uid: &str) -> Result<()> {
        let entry = self.dir.join(format!("{namespace}_{pod}_{uid}"));
        fs::create_dir(&entry).with_context(|| format!("creating {}", entry.display()))
    }

    /// The flags of a daemon that follows the fixture workloads of the
    /// test's containers (a /proc scan every 200 ms, no NVML), serves
    /// /metrics on `listen` and names pods from this directory.
    pub fn daemon_args(&self, listen: std::net::SocketAddr) -> Vec<String> {
        let mut args = crate::tracer::workload_daemon_args(listen);
        args.extend(["--pod-log-dir".into(), self.dir.display().to_string()]);
        args
    }
}

impl Drop for PodLogDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Makes the process `cmd` starts join the root cgroup before it runs.
pub fn place_in_root_cgroup(cmd: &mut Command) -> Result<()> {
    let procs = CString::new(cgroup2_root()?.join("cgroup.procs").as_os_str().as_bytes())?;
    // SAFETY: only async-signal-safe calls on data prepared here.
    unsafe {
        cmd.pre_exec(move || join_cgroup(&procs));
    }
    Ok(())
}

/// Where the cgroup v2 hierarchy is mounted (`/sys/fs/cgroup`, or
/// `/sys/fs/cgroup/unified` on a hybrid host).
pub fn cgroup2_root() -> Result<PathBuf> {
    let mounts = fs::read_to_string("/proc/self/mounts")?;
    mounts
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(f[1]))
        })
        .context("no cgroup v2 hierarchy is mounted")
}
