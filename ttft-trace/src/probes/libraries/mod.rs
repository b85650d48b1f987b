//! The generic library finder and attacher: finding the code of the probed
//! families ([`super::symbols::FAMILIES`]) that a process runs, and putting
//! the probes on it. Every mapped ELF file that defines a family's marker
//! is one, whatever it is called (a versioned `libcudart.so.12`, a hashed
//! copy inside a wheel, or an extension module with the runtime linked in
//! statically, whose symbols are only in `.symtab`).
//!
//! The file inspected is the file mapped: it is opened through
//! `/proc/PID/map_files/<range>` (the mapping's own file, not a path that a
//! container could re-point; [`maps`]), checked to be a regular file (a
//! device such as `/dev/nvidia0` is never opened) whose device and inode
//! are those of the maps entry, and read with plain reads under a budget
//! (no shared mapping that a truncation would turn into SIGBUS; [`elf`]).
//! The probes are then attached through that same open file
//! (`/proc/self/fd/N`), once per real file ([`FileId`]) and reach
//! ([`attach`]). A [`Scanner`] remembers what each file was, so a rescan
//! reads `/proc/PID/maps` only.

mod attach;
mod elf;
mod file_id;
mod maps;
mod quarantine;
mod scanner;
mod tls;

pub use attach::{Attached, Reach};
pub(super) use attach::{Probed, uprobe, uprobe_error};
pub use file_id::FileId;
pub use maps::{MappedFile, mapped_files, parse_maps};
pub use scanner::{ReadStats, Scan, Scanner};
pub use tls::TlsLibrary;

use std::{
    fs::File,
    path::{Path, PathBuf},
    sync::Arc,
};

use thiserror::Error;

use super::symbols::{Family, ProbedSymbol};
use crate::host::rootfs::{self, RootfsError};
use elf::{COPIES_MAX, ELF_READ_MAX, SYMBOLS_MAX};

#[derive(Debug, Error)]
pub enum LibraryError {
    #[error(transparent)]
    File(#[from] RootfsError),
    #[error("no process with pid {0}")]
    NoProcess(u32),
    #[error("cannot read {0}: {1}")]
    Io(PathBuf, std::io::Error),
    #[error(
        "{path}: the file opened is {found_dev:x}:{found_ino}, the mapping is of {dev:x}:{ino}"
    )]
    NotTheMappedFile {
        path: PathBuf,
        dev: u64,
        ino: u64,
        found_dev: u64,
        found_ino: u64,
    },
    #[error(
        "{0}: over {ELF_READ_MAX} bytes of headers and symbol tables, or over {SYMBOLS_MAX} symbols"
    )]
    TooLarge(PathBuf),
    #[error("{path}: {name} defined at over {COPIES_MAX} addresses; not probed")]
    TooManyCopies { path: PathBuf, name: &'static str },
    #[error("pid {pid}: a read of its files: {why}")]
    Overdue {
        pid: u32,
        why: crate::host::deadline::Overdue,
    },
    #[error("pid {0} is set aside: a read of its files did not return")]
    SetAside(u32),
    #[error("pid {pid} not read: {held} reads of {tenant}'s files are stuck, its share")]
    TenantStuck {
        pid: u32,
        tenant: String,
        held: usize,
    },
}

impl LibraryError {
    /// Whether the file was refused for a cap on the ELF work it asks for.
    /// Which cap, as the `reason` label of
    /// `ttft_trace_libraries_refused_total` names it.
    fn over_cap(&self) -> Option<&'static str> {
        match self {
            LibraryError::TooLarge(_) => Some("too_large"),
            LibraryError::TooManyCopies { .. } => Some("too_many_copies"),
            _ => None,
        }
    }

    fn is_permission(&self) -> bool {
        match self {
            LibraryError::File(RootfsError::Open { source, .. }) => {
                source.kind() == std::io::ErrorKind::PermissionDenied
            }
            _ => false,
        }
    }

    /// Whether the error is the process's (it exited, its mapping went
    /// away), not the file's: such a failure is not remembered.
    fn is_transient(&self) -> bool {
        match self {
            // The mapping was replaced between the read of maps and the
            // open of its file (a remap race): what was opened says nothing
            // of the file the maps line names, whose key this would be.
            LibraryError::NoProcess(_) | LibraryError::NotTheMappedFile { .. } => true,
            LibraryError::File(RootfsError::Open { source, .. }) => {
                source.kind() == std::io::ErrorKind::NotFound
            }
            _ => false,
        }
    }
}

/// A file that defines probed functions, with the file offset of each.
#[derive(Debug, Clone)]
pub struct Library {
    /// The path as the process that showed it sees it (for messages).
    pub path: PathBuf,
    /// The file inspected, kept open: the probes attach through it.
    pub file: Arc<File>,
    /// `/proc/self/fd/N` of [`Library::file`]: the path to attach by.
    pub open_path: PathBuf,
    /// Which file the probes land on.
    pub id: FileId,
    /// The families (APIs) whose functions it defines, in the order of
    /// [`super::symbols::FAMILIES`].
    pub apis: Vec<&'static Family>,
    /// Probed symbols and their file offsets (one symbol may appear at more
    /// than one offset when several versions are defined), in the order
    /// they are attached in ([`super::symbols::Role`]).
    pub symbols: Vec<(&'static ProbedSymbol, u64)>,
    /// The TLS library it carries as well, if any.
    pub tls: Option<TlsLibrary>,
}

/// Reads an ELF file of the daemon's own namespace (a library the user
/// named; `path` for messages, opened at `open_path`) and returns the
/// probed functions it defines, or None when it is no library to probe.
/// Files that are not ELF are None, not errors.
pub fn inspect(path: &Path, open_path: &Path) -> Result<Option<Library>, LibraryError> {
    let file = rootfs::open_regular_file(open_path)?;
    Ok(elf::inspect_file(path, file)?.library)
}

/// The TLS library a file of the daemon's own namespace carries (`check
/// --pid` reads a target's through its `/proc/PID/map_files` links).
pub fn tls_library(path: &Path) -> Result<Option<TlsLibrary>, LibraryError> {
    let file = rootfs::open_regular_file(path)?;
    Ok(elf::inspect_file(path, file)?.tls)
}

impl Library {
    /// Whether the file defines functions of `family`.
    pub fn is(&self, family: &Family) -> bool {
        self.apis.contains(&family)
    }

    /// The library less `family`'s functions (to probe the rest first).
    pub fn without(&self, family: &Family) -> Library {
        Library {
            apis: self
                .apis
                .iter()
                .copied()
                .filter(|f| f.name != family.name)
                .collect(),
            symbols: self
                .symbols
                .iter()
                .copied()
                .filter(|(sym, _)| !family.owns(sym))
                .collect(),
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_binary_is_no_cuda_library() {
        let exe = std::env::current_exe().expect("test binary path");
        assert!(inspect(&exe, &exe).expect("readable").is_none());
        // Not regular files: refused, never read.
        for path in ["/proc/self", "/dev/zero", "/dev/null"] {
            let p = Path::new(path);
            assert!(
                matches!(
                    inspect(p, p),
                    Err(LibraryError::File(RootfsError::NotRegular { .. }))
                ),
                "{path}"
            );
        }
    }
}
