//! The files the daemon writes itself (the JSONL log): opened without
//! following a symlink in any component of the path, and only inside the
//! directory the path names. Root writing into a directory that others can
//! write to (`/tmp`, a volume shared with a pod) must not be turned into a
//! write to `/etc/shadow` by a symlink planted there, at start or at a
//! SIGHUP reopen.

use std::{
    fs::File,
    io,
    path::{Path, PathBuf},
};

use thiserror::Error;

use super::rootfs::openat2_mode;

#[derive(Debug, Error)]
pub enum OwnFileError {
    #[error("{path}: names no file inside a directory")]
    NoFileName { path: PathBuf },
    #[error(
        "cannot open the directory {dir} without following symlinks (a symlink in the path is \
         refused): {source}"
    )]
    Dir { dir: PathBuf, source: io::Error },
    #[error("cannot open {path} inside {dir} without following a symlink: {source}")]
    File {
        path: PathBuf,
        dir: PathBuf,
        source: io::Error,
    },
}

/// Opens `path` for append, creating it with `mode`: every component is
/// resolved with `RESOLVE_NO_SYMLINKS` (a symlink anywhere, the file itself
/// included, is refused with `ELOOP`), and the file is opened beneath its
/// directory's descriptor (`RESOLVE_BENEATH`), so a rename of a component
/// between the two opens cannot lead outside it.
pub fn open_append_no_symlinks(path: &Path, mode: u32) -> Result<File, OwnFileError> {
    let no_name = || OwnFileError::NoFileName {
        path: path.to_path_buf(),
    };
    let name = path.file_name().ok_or_else(no_name)?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let resolve = libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
    let dir_fd = openat2_mode(
        libc::AT_FDCWD,
        &dir,
        libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        0,
        resolve,
    )
    .map_err(|source| OwnFileError::Dir {
        dir: dir.clone(),
        source: explain_loop(source),
    })?;
    let flags = libc::O_WRONLY | libc::O_APPEND | libc::O_CREAT | libc::O_NOCTTY | libc::O_CLOEXEC;
    let file = openat2_mode(
        std::os::fd::AsRawFd::as_raw_fd(&dir_fd),
        Path::new(name),
        flags,
        mode,
        resolve | libc::RESOLVE_BENEATH,
    )
    .map_err(|source| OwnFileError::File {
        path: path.to_path_buf(),
        dir,
        source: explain_loop(source),
    })?;
    Ok(File::from(file))
}

/// `ELOOP` is what `RESOLVE_NO_SYMLINKS` answers for a symlink: say so.
fn explain_loop(e: io::Error) -> io::Error {
    if e.raw_os_error() == Some(libc::ELOOP) {
        io::Error::other("a component is a symlink, which is not followed")
    } else {
        e
    }
}

#[cfg(test)]
mod tests {
    use std::{io::Write, os::unix::fs::symlink};

    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ttft-own-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("real")).expect("scratch dir");
        dir
    }

    #[test]
    fn creates_and_appends_a_plain_path() {
        let dir = scratch("plain");
        let path = dir.join("real/out.jsonl");
        for line in ["a\n", "b\n"] {
            let mut f = open_append_no_symlinks(&path, 0o640).expect("opens");
            f.write_all(line.as_bytes()).expect("writes");
        }
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "a\nb\n");
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn refuses_a_symlinked_file_and_a_symlinked_directory() {
        let dir = scratch("links");
        let target = dir.join("target");
        std::fs::write(&target, "precious\n").expect("target");
        symlink(&target, dir.join("real/out.jsonl")).expect("file link");
        symlink(dir.join("real"), dir.join("linkdir")).expect("dir link");
        for path in [dir.join("real/out.jsonl"), dir.join("linkdir/new.jsonl")] {
            let err = open_append_no_symlinks(&path, 0o640).expect_err("a symlink is refused");
            assert!(err.to_string().contains("symlink"), "{err}");
        }
        assert_eq!(
            std::fs::read_to_string(&target).expect("read"),
            "precious\n",
            "the symlink's target is untouched"
        );
        assert!(
            !dir.join("real/new.jsonl").exists(),
            "nothing created through the link"
        );
        std::fs::remove_dir_all(dir).ok();
    }
}
