//! Scanning processes' mappings for libraries to probe, remembering what
//! each file turned out to be.

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use super::{FileId, Library, LibraryError, elf, maps};

/// Most files remembered by a [`Scanner`]; past that, what it remembers of
/// files that are no library to probe (or failed) is forgotten.
const SCANNER_CACHE_MAX: usize = 65_536;

/// What one scan of a process found.
#[derive(Debug, Default)]
pub struct Scan {
    pub libraries: Vec<Arc<Library>>,
    /// Every mapped file that was looked at (for the "nothing found" error).
    pub searched: Vec<PathBuf>,
    /// Mapped files this process may not open (permission denied).
    pub denied: Vec<PathBuf>,
}

/// What a file turned out to be.
#[derive(Debug, Clone)]
enum Seen {
    Library(Arc<Library>),
    /// No library to probe, or a file that cannot be inspected (not regular,
    /// not the mapped file, too large, unreadable): not tried again.
    Other,
    /// A file we may not open.
    Denied,
}

/// Scans processes' mappings, remembering what each file (by the device
/// and inode of its mapping) turned out to be, so that rescans cost a read
/// of /proc/PID/maps.
#[derive(Default)]
pub struct Scanner {
    cache: HashMap<(u64, u64), Seen>,
    /// When a scan last found each library mapped (libraries hold their
    /// file open: see [`Scanner::forget_unused`]).
    last_found: HashMap<(u64, u64), Instant>,
}

impl Scanner {
    /// Files inspected and remembered so far.
    pub fn files_seen(&self) -> usize {
        self.cache.len()
    }

    /// The libraries process `pid` maps, each file inspected once.
    pub fn scan(&mut self, pid: u32) -> Result<Scan, LibraryError> {
        let mut scan = Scan::default();
        for mapped in maps::mapped_files(pid)? {
            scan.searched.push(mapped.path.clone());
            let key = (mapped.dev, mapped.inode);
            let seen = match self.cache.get(&key) {
                Some(seen) => seen.clone(),
                None => {
                    // The process exited or unmapped it meanwhile: a later
                    // scan tries again.
                    let Some(seen) = inspect_mapped(&mapped) else {
                        continue;
                    };
                    self.remember(key, seen.clone());
                    seen
                }
            };
            match seen {
                Seen::Library(lib) => {
                    self.last_found.insert(key, Instant::now());
                    scan.libraries.push(lib);
                }
                Seen::Denied => scan.denied.push(mapped.path),
                Seen::Other => {}
            }
        }
        Ok(scan)
    }

    /// Forgets the libraries no scan has found mapped for `max_age`, unless
    /// `keep` says their file is probed: each holds its file open, and the
    /// files of a host's CUDA processes come and go (image updates, copies
    /// in temporary directories): a deleted file would stay on the disk,
    /// and the descriptors would add up. Returns how many were forgotten.
    pub fn forget_unused(&mut self, max_age: Duration, keep: impl Fn(&FileId) -> bool) -> usize {
        let before = self.cache.len();
        let last_found = &mut self.last_found;
        self.cache.retain(|key, seen| match seen {
            Seen::Library(lib) => {
                keep(&lib.id) || last_found.get(key).is_some_and(|t| t.elapsed() < max_age)
            }
            Seen::Other | Seen::Denied => true,
        });
        let cache = &self.cache;
        last_found.retain(|key, _| cache.contains_key(key));
        before - self.cache.len()
    }

    /// Remembers a file; past [`SCANNER_CACHE_MAX`], forgets every file
    /// that is no library (libraries are few, and hold the probes' files).
    fn remember(&mut self, key: (u64, u64), seen: Seen) {
        if self.cache.len() >= SCANNER_CACHE_MAX {
            self.cache.retain(|_, s| matches!(s, Seen::Library(_)));
        }
        self.cache.insert(key, seen);
    }
}

/// What a mapped file is, or None where the failure was the process's
/// (not remembered).
fn inspect_mapped(mapped: &maps::MappedFile) -> Option<Seen> {
    match maps::open_mapped(mapped).and_then(|file| elf::inspect_file(&mapped.path, file)) {
        Ok(Some(lib)) => Some(Seen::Library(Arc::new(lib))),
        Ok(None) => Some(Seen::Other),
        Err(e) if e.is_transient() => None,
        Err(e) => {
            // A file over a cap is worth an operator's eye (a hostile or
            // broken library is left unprobed); it is remembered, so this
            // is said once per file.
            if e.is_over_cap() {
                log::warn!("not probing {}: {e}", mapped.path.display());
            } else {
                log::debug!("not inspecting {}: {e}", mapped.path.display());
            }
            Some(if e.is_permission() {
                Seen::Denied
            } else {
                Seen::Other
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::rootfs;

    #[test]
    fn every_mapped_file_is_remembered() {
        let me = std::process::id();
        let files = maps::mapped_files(me).expect("own maps");
        let mut scanner = Scanner::default();
        let scan = scanner.scan(me).expect("scan");
        assert!(scan.libraries.is_empty());
        assert_eq!(scanner.cache.len(), files.len(), "every file remembered");
    }

    #[test]
    fn libraries_not_found_lately_and_not_probed_are_forgotten() {
        let exe = std::env::current_exe().expect("test binary path");
        let file = Arc::new(rootfs::open_regular_file(&exe).expect("open"));
        let lib = |ino| {
            Seen::Library(Arc::new(Library {
                path: exe.clone(),
                file: file.clone(),
                open_path: exe.clone(),
                id: FileId::Inode { dev: 1, ino },
                apis: Vec::new(),
                symbols: Vec::new(),
            }))
        };
        let mut scanner = Scanner::default();
        // Found just now; found long ago (or never); probed; no library.
        scanner.cache.insert((1, 1), lib(1));
        scanner.last_found.insert((1, 1), Instant::now());
        scanner.cache.insert((1, 2), lib(2));
        scanner.cache.insert((1, 3), lib(3));
        scanner.cache.insert((1, 4), Seen::Other);
        let probed = FileId::Inode { dev: 1, ino: 3 };
        let forgotten = scanner.forget_unused(Duration::from_secs(60), |id| *id == probed);
        assert_eq!(forgotten, 1);
        let mut left: Vec<_> = scanner.cache.keys().copied().collect();
        left.sort_unstable();
        assert_eq!(left, vec![(1, 1), (1, 3), (1, 4)]);
        // Once it is old too, only the probed one stays of the libraries.
        assert_eq!(scanner.forget_unused(Duration::ZERO, |id| *id == probed), 1);
        assert!(scanner.last_found.is_empty());
        assert_eq!(scanner.cache.len(), 2);
    }
}
