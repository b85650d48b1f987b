//! Reading files of a traced process, which may live in a container whose
//! files anyone inside it could have written: hostile input for a root
//! daemon.
//!
//! A path of the target is resolved inside the target's own root
//! (`/proc/PID/root` opened as a directory, then `openat2` with
//! `RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`): an absolute symlink such as
//! `/var/run -> /run` or `namespace -> /etc/shadow` is followed from the
//! container's root, never from the daemon's, and `..` stops at that root.
//! Mount points inside the container are crossed (the service-account
//! namespace is a mount of its own), so `RESOLVE_NO_XDEV` is not used.
//!
//! The file is first opened `O_PATH`, which opens nothing: a FIFO, a device
//! (`/dev/zero`, `/dev/nvidia0`) or a socket is refused on its `fstat`
//! without its driver ever seeing an open, and without blocking. Only a
//! regular file is then reopened for reading (through `/proc/self/fd`, the
//! same inode), non-blocking, and read up to a cap that is checked against
//! its size before any byte is read.

use std::{
    ffi::CString,
    fs::File,
    io::{self, Read},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::{ffi::OsStrExt, fs::MetadataExt},
    },
    path::{Path, PathBuf},
};

use thiserror::Error;

use super::deadline;

/// Flags of every open of a target's file or of a /proc file: never
/// blocking (a FIFO without a writer), never becoming our controlling
/// terminal, never inherited by a child.
const READ_FLAGS: libc::c_int =
    libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC;

#[derive(Debug, Error)]
pub enum RootfsError {
    #[error("cannot open the root directory of process {pid}: {source}")]
    Root { pid: u32, source: io::Error },
    #[error("cannot open {path}: {source}")]
    Open { path: PathBuf, source: io::Error },
    #[error("{path} is a {kind}, not a regular file")]
    NotRegular { path: PathBuf, kind: &'static str },
    #[error("{path} is {size} bytes, over the {cap} read from a target")]
    TooLarge { path: PathBuf, size: u64, cap: u64 },
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
}

impl RootfsError {
    /// Whether the file is simply absent (the usual case on a bare host).
    pub fn is_not_found(&self) -> bool {
        matches!(self, RootfsError::Open { source, .. } if source.kind() == io::ErrorKind::NotFound)
    }
}

/// The root directory of a process (or any directory treated as one).
#[derive(Debug)]
pub struct Root {
    fd: OwnedFd,
}

impl Root {
    /// The root of process `pid`, as its own mount namespace has it.
    pub fn of_process(pid: u32) -> Result<Self, RootfsError> {
        Self::open_dir(Path::new(&format!("/proc/{pid}/root")))
            .map_err(|source| RootfsError::Root { pid, source })
    }

    /// A directory of ours treated as a root (tests, a mounted image).
    pub fn at(dir: &Path) -> io::Result<Self> {
        Self::open_dir(dir)
    }

    fn open_dir(dir: &Path) -> io::Result<Self> {
        let c = cstring(dir)?;
        // SAFETY: a NUL-terminated path and plain flags; the result is checked.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd was just returned by open and is owned by nobody else.
        Ok(Self {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Opens the regular file at `path` (absolute or not, it is taken
    /// from this root), resolved inside this root. Anything else is refused
    /// without being opened for reading.
    pub fn open_regular(&self, path: &Path) -> Result<File, RootfsError> {
        let open_err = |source| RootfsError::Open {
            path: path.to_path_buf(),
            source,
        };
        let handle = openat2(
            &self.fd,
            path,
            libc::O_PATH | libc::O_CLOEXEC,
            libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS,
        )
        .map_err(open_err)?;
        reopen_regular(File::from(handle), path)
    }

    /// The content of the regular file at `path` inside this root, refused
    /// when larger than `cap` bytes.
    pub fn read(&self, path: &Path, cap: u64) -> Result<Vec<u8>, RootfsError> {
        let file = self.open_regular(path)?;
        let size = file
            .metadata()
            .map_err(|source| RootfsError::Read {
                path: path.to_path_buf(),
                source,
            })?
            .len();
        if size > cap {
            return Err(RootfsError::TooLarge {
                path: path.to_path_buf(),
                size,
                cap,
            });
        }
        let (bytes, complete) = read_capped(file, cap).map_err(|source| RootfsError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        if !complete {
            // It grew past the cap after the size check.
            return Err(RootfsError::TooLarge {
                path: path.to_path_buf(),
                size: cap + 1,
                cap,
            });
        }
        Ok(bytes)
    }
}

/// Opens a path of ours (a library the user named, a
/// `/proc/PID/map_files` entry) when it is a regular file; anything else
/// is refused without being opened for reading.
pub fn open_regular_file(path: &Path) -> Result<File, RootfsError> {
    let open_err = |source| RootfsError::Open {
        path: path.to_path_buf(),
        source,
    };
    let c = cstring(path).map_err(open_err)?;
    // SAFETY: a NUL-terminated path and plain flags; the result is checked.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(open_err(io::Error::last_os_error()));
    }
    // SAFETY: fd was just returned by open and is owned by nobody else.
    reopen_regular(File::from(unsafe { OwnedFd::from_raw_fd(fd) }), path)
}

/// The regular file behind an `O_PATH` handle, opened for reading; the
/// handle's file of any other kind is refused. Reopening through
/// `/proc/self/fd` reaches the very inode checked, whatever is done to the
/// path meanwhile.
fn reopen_regular(handle: File, path: &Path) -> Result<File, RootfsError> {
    let open_err = |source| RootfsError::Open {
        path: path.to_path_buf(),
        source,
    };
    let stat = handle.metadata().map_err(open_err)?;
    let kind = file_kind(stat.mode());
    if kind != "regular file" {
        return Err(RootfsError::NotRegular {
            path: path.to_path_buf(),
            kind,
        });
    }
    let reopened = format!("/proc/self/fd/{}", handle.as_raw_fd());
    let file = open_plain(Path::new(&reopened)).map_err(open_err)?;
    let now = file.metadata().map_err(open_err)?;
    if (now.dev(), now.ino()) != (stat.dev(), stat.ino()) {
        return Err(open_err(io::Error::other("the file changed while opening")));
    }
    Ok(file)
}

/// Reads a file of /proc (`/proc/PID/environ`, `/proc/PID/cgroup`): the
/// kernel writes these, not the target, but their length is the target's
/// to choose (a huge environment, a deep cgroup path). Non-blocking, and at
/// most `cap` bytes: the rest is left unread.
pub fn read_proc(path: &Path, cap: u64) -> io::Result<Vec<u8>> {
    Ok(read_capped(open_plain(path)?, cap)?.0)
}

/// Opens a path of ours for reading with [`READ_FLAGS`].
fn open_plain(path: &Path) -> io::Result<File> {
    let c = cstring(path)?;
    // SAFETY: a NUL-terminated path and plain flags; the result is checked.
    let fd = unsafe { libc::open(c.as_ptr(), READ_FLAGS) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by open and is owned by nobody else.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Up to `cap` bytes of `file`, and whether that was all of it.
fn read_capped(file: File, cap: u64) -> io::Result<(Vec<u8>, bool)> {
    let mut bytes = Vec::new();
    // One byte past the cap tells a file of exactly `cap` bytes from a longer one.
    let mut rest = file.take(cap.saturating_add(1));
    // Read by chunks, each returned read counted as progress for a
    // deadline (a 16 MiB /proc/PID/maps is generated by many reads).
    let mut chunk = [0u8; 64 << 10];
    loop {
        match rest.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => bytes.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
        deadline::progress();
    }
    let complete = bytes.len() as u64 <= cap;
    bytes.truncate(usize::try_from(cap).unwrap_or(usize::MAX));
    Ok((bytes, complete))
}

/// `openat2(2)` of `path` from `dir` (mode 0 unless `flags` creates).
pub(super) fn openat2(
    dir: &impl AsRawFd,
    path: &Path,
    flags: libc::c_int,
    resolve: u64,
) -> io::Result<OwnedFd> {
    openat2_mode(dir.as_raw_fd(), path, flags, 0, resolve)
}

/// `openat2(2)` from the raw directory `dir` (`AT_FDCWD` allowed), with the
/// `mode` of a file it creates.
pub(super) fn openat2_mode(
    dir: libc::c_int,
    path: &Path,
    flags: libc::c_int,
    mode: u32,
    resolve: u64,
) -> io::Result<OwnedFd> {
    let c = cstring(path)?;
    // SAFETY: open_how is plain data; zeroed is a valid value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = flags as u64;
    how.mode = u64::from(mode);
    how.resolve = resolve;
    // SAFETY: a valid dirfd, a NUL-terminated path and a correctly sized
    // open_how; the result is checked.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir,
            c.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = libc::c_int::try_from(fd).map_err(|_| io::Error::other("openat2 returned no fd"))?;
    // SAFETY: fd was just returned by openat2 and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn cstring(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))
}

/// What a file mode names, for messages.
pub fn file_kind(mode: u32) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFREG => "regular file",
        libc::S_IFDIR => "directory",
        libc::S_IFIFO => "FIFO",
        libc::S_IFCHR => "character device",
        libc::S_IFBLK => "block device",
        libc::S_IFSOCK => "socket",
        libc::S_IFLNK => "symbolic link",
        _ => "file of unknown type",
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    /// A directory tree standing for a container's root, removed on drop.
    struct Tree(PathBuf);

    impl Tree {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!(
                "ttft-rootfs-{name}-{}-{}",
                std::process::id(),
                crate::host::clock::monotonic_ns()
            ));
            std::fs::create_dir_all(dir.join("etc")).expect("mkdir");
            Self(dir)
        }

        fn path(&self, rel: &str) -> PathBuf {
            self.0.join(rel)
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn mkfifo(path: &Path) {
        let c = cstring(path).expect("path");
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    }

    #[test]
    fn reads_a_regular_file_and_follows_symlinks_inside_the_root() {
        let t = Tree::new("plain");
        std::fs::write(t.path("etc/hostname"), "vllm-0\n").expect("write");
        std::fs::create_dir_all(t.path("run/secrets")).expect("mkdir");
        std::fs::write(t.path("run/secrets/namespace"), "serving").expect("write");
        // The usual `/var/run -> /run`: absolute, so resolved from the root.
        std::fs::create_dir_all(t.path("var")).expect("mkdir");
        symlink("/run", t.path("var/run")).expect("symlink");
        let root = Root::at(&t.0).expect("root");
        assert_eq!(
            root.read(Path::new("/etc/hostname"), 64).expect("read"),
            b"vllm-0\n"
        );
        assert_eq!(
            root.read(Path::new("/var/run/secrets/namespace"), 64)
                .expect("read through /var/run"),
            b"serving"
        );
    }

    #[test]
    fn symlinks_and_dotdot_never_leave_the_root() {
        let outside = Tree::new("outside");
        std::fs::write(outside.path("etc/canary"), "host secret").expect("write");
        let t = Tree::new("escape");
        // Absolute, relative-upward and `..` paths all stay inside `t`.
        symlink(outside.path("etc/canary"), t.path("etc/abs")).expect("symlink");
        let up = format!(
            "../../../../../../..{}",
            outside.path("etc/canary").display()
        );
        symlink(&up, t.path("etc/rel")).expect("symlink");
        symlink("/proc/self/root/etc/hostname", t.path("etc/magic")).expect("symlink");
        let root = Root::at(&t.0).expect("root");
        for path in ["/etc/abs", "/etc/rel", "/etc/magic", up.as_str()] {
            let got = root.read(Path::new(path), 64);
            assert!(
                matches!(&got, Err(RootfsError::Open { .. })),
                "{path}: {got:?}"
            );
        }
        // The same symlink resolved inside the root reaches the root's own
        // copy of the path, as the container itself would.
        std::fs::create_dir_all(t.path(&outside.0.display().to_string()[1..]).join("etc"))
            .expect("mkdir");
        std::fs::write(
            t.path(&outside.path("etc/canary").display().to_string()[1..]),
            "inside",
        )
        .expect("write");
        assert_eq!(
            root.read(Path::new("/etc/abs"), 64).expect("read"),
            b"inside"
        );
    }

    #[test]
    fn refuses_fifos_devices_and_directories_without_blocking() {
        let t = Tree::new("special");
        // A FIFO with no writer: an open for reading would block without
        // O_NONBLOCK, and a read of it must never be attempted.
        mkfifo(&t.path("etc/fifo"));
        symlink("/etc/fifo", t.path("etc/to-fifo")).expect("symlink");
        let root = Root::at(&t.0).expect("root");
        for path in ["/etc/fifo", "/etc/to-fifo"] {
            match root.read(Path::new(path), 64) {
                Err(RootfsError::NotRegular { kind, .. }) => assert_eq!(kind, "FIFO"),
                other => panic!("{path}: {other:?}"),
            }
        }
        match root.read(Path::new("/etc"), 64) {
            Err(RootfsError::NotRegular { kind, .. }) => assert_eq!(kind, "directory"),
            other => panic!("/etc: {other:?}"),
        }
        // A character device through a symlink: our own `/` taken as the
        // root, so that `/dev/zero` is inside it.
        symlink("/dev/zero", t.path("etc/zero")).expect("symlink");
        let host = Root::at(Path::new("/")).expect("/");
        match host.read(&t.path("etc/zero"), 64) {
            Err(RootfsError::NotRegular { kind, .. }) => assert_eq!(kind, "character device"),
            other => panic!("/dev/zero: {other:?}"),
        }
    }

    #[test]
    fn caps_the_size() {
        let t = Tree::new("large");
        let big = File::create(t.path("etc/big")).expect("create");
        // Sparse: a gigabyte that takes no disk.
        big.set_len(1 << 30).expect("set_len");
        std::fs::write(t.path("etc/exact"), [b'x'; 64]).expect("write");
        let root = Root::at(&t.0).expect("root");
        match root.read(Path::new("/etc/big"), 4096) {
            Err(RootfsError::TooLarge { size, cap, .. }) => {
                assert_eq!((size, cap), (1 << 30, 4096));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            root.read(Path::new("/etc/exact"), 64).expect("read").len(),
            64
        );
        assert!(matches!(
            root.read(Path::new("/etc/exact"), 63),
            Err(RootfsError::TooLarge { .. })
        ));
        assert!(
            root.read(Path::new("/etc/missing"), 64)
                .expect_err("absent")
                .is_not_found()
        );
    }

    #[test]
    fn proc_reads_are_capped() {
        let own = read_proc(Path::new("/proc/self/environ"), 1 << 20).expect("environ");
        let capped = read_proc(Path::new("/proc/self/environ"), 8).expect("environ");
        assert_eq!(capped.len(), own.len().min(8));
        assert_eq!(capped[..], own[..capped.len()]);
        // The root of a process (our own here) reads its files by their
        // absolute paths, but no magic link of /proc is followed.
        let t = Tree::new("own");
        std::fs::write(t.path("etc/hostname"), "own").expect("write");
        let of_self = Root::of_process(std::process::id()).expect("own root");
        assert_eq!(
            of_self.read(&t.path("etc/hostname"), 64).expect("read"),
            b"own"
        );
        let file = File::open(t.path("etc/hostname")).expect("open");
        let magic = format!("/proc/self/fd/{}", file.as_raw_fd());
        assert!(matches!(
            of_self.read(Path::new(&magic), 64),
            Err(RootfsError::Open { .. })
        ));
    }
}
