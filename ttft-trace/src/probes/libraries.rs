//! Finding the CUDA runtime and driver code a process runs: every mapped ELF
//! file that defines the probed entry points, whatever it is called (a
//! versioned `libcudart.so.12`, a hashed copy inside a wheel, or an
//! extension module with the runtime linked in statically, whose symbols are
//! only in `.symtab`).

use std::{
    collections::{BTreeSet, HashMap},
    fs,
    path::{Path, PathBuf},
    sync::Arc,
};

use object::{Object, ObjectSegment, ObjectSymbol, SymbolKind};
use thiserror::Error;

use super::symbols::{self, Api, MARKERS, ProbedSymbol};

#[derive(Debug, Error)]
pub enum LibraryError {
    #[error("cannot read {0}: {1}")]
    Io(PathBuf, std::io::Error),
    #[error("no process with pid {0}")]
    NoProcess(u32),
}

/// A file-backed mapping of a process, as listed in `/proc/PID/maps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MappedFile {
    /// The path as the process sees it.
    pub path: PathBuf,
    /// The same file reached through `/proc/PID/root`, so that files inside
    /// another mount namespace (a container) open from here.
    pub open_path: PathBuf,
    /// Device and inode: the identity of the file, which is what a uprobe
    /// attaches to.
    pub dev: String,
    pub inode: u64,
}

/// The distinct files mapped by `pid`.
pub fn mapped_files(pid: u32) -> Result<Vec<MappedFile>, LibraryError> {
    let maps = format!("/proc/{pid}/maps");
    let text = match fs::read_to_string(&maps) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(LibraryError::NoProcess(pid));
        }
        Err(e) => return Err(LibraryError::Io(maps.into(), e)),
    };
    Ok(parse_maps(pid, &text))
}

pub fn parse_maps(pid: u32, text: &str) -> Vec<MappedFile> {
    let mut seen = BTreeSet::new();
    let mut files = Vec::new();
    for line in text.lines() {
        // addr perms offset dev inode path (the path may contain spaces)
        let mut parts = line.splitn(6, ' ');
        let (Some(_), Some(_), Some(_), Some(dev), Some(inode), Some(path)) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            continue;
        };
        let path = path.trim_start();
        let Ok(inode) = inode.parse::<u64>() else {
            continue;
        };
        if inode == 0 || !path.starts_with('/') || path.ends_with(" (deleted)") {
            continue;
        }
        if !seen.insert((dev.to_string(), inode)) {
            continue;
        }
        files.push(MappedFile {
            path: PathBuf::from(path),
            open_path: PathBuf::from(format!("/proc/{pid}/root{path}")),
            dev: dev.to_string(),
            inode,
        });
    }
    files
}

/// A file that defines CUDA entry points, with the file offset of each.
#[derive(Debug, Clone)]
pub struct CudaLibrary {
    pub path: PathBuf,
    pub open_path: PathBuf,
    pub apis: BTreeSet<Api>,
    /// Probed symbols and their file offsets (one symbol may appear at more
    /// than one offset when several versions are defined).
    pub symbols: Vec<(&'static ProbedSymbol, u64)>,
}

/// Reads an ELF file's symbol tables (`.dynsym` and `.symtab`) and returns
/// the CUDA entry points it defines, or None when it is no CUDA library.
/// Files that are not ELF are None, not errors.
pub fn inspect(path: &Path, open_path: &Path) -> Result<Option<CudaLibrary>, LibraryError> {
    let file = fs::File::open(open_path).map_err(|e| LibraryError::Io(open_path.into(), e))?;
    // SAFETY: a read-only private mapping; a concurrent truncation of a
    // mapped library would crash the target as well, and object only reads.
    let map = match unsafe { memmap2::Mmap::map(&file) } {
        Ok(m) => m,
        Err(e) => return Err(LibraryError::Io(open_path.into(), e)),
    };
    let Ok(elf) = object::File::parse(&*map) else {
        return Ok(None);
    };
    let mut found: Vec<(&'static ProbedSymbol, u64)> = Vec::new();
    for sym in elf.dynamic_symbols().chain(elf.symbols()) {
        if !sym.is_definition() || sym.kind() != SymbolKind::Text {
            continue;
        }
        let Some(probed) = sym.name().ok().and_then(symbols::lookup) else {
            continue;
        };
        if let Some(offset) = file_offset(&elf, sym.address())
            && !found
                .iter()
                .any(|(s, o)| s.name == probed.name && *o == offset)
        {
            found.push((probed, offset));
        }
    }
    if !found.iter().any(|(s, _)| MARKERS.contains(&s.name)) {
        return Ok(None);
    }
    let apis = found.iter().map(|(s, _)| s.api).collect();
    found.sort_by_key(|(s, o)| (s.name, *o));
    Ok(Some(CudaLibrary {
        path: path.into(),
        open_path: open_path.into(),
        apis,
        symbols: found,
    }))
}

/// Converts a virtual address to the file offset a uprobe wants, through the
/// loadable segment that holds it.
fn file_offset(elf: &object::File<'_>, addr: u64) -> Option<u64> {
    elf.segments().find_map(|seg| {
        let (offset, size) = seg.file_range();
        let start = seg.address();
        (addr >= start && addr < start + size).then(|| addr - start + offset)
    })
}

/// What one scan of a process found.
#[derive(Debug, Default)]
pub struct Scan {
    pub libraries: Vec<Arc<CudaLibrary>>,
    /// Every mapped file that was looked at (for the "nothing found" error).
    pub searched: Vec<PathBuf>,
    /// Mapped files this process may not open (permission denied).
    pub denied: Vec<PathBuf>,
}

/// Scans processes' mappings, remembering what each file (by device and
/// inode) turned out to be, so that rescans cost a read of /proc/PID/maps.
#[derive(Default)]
pub struct Scanner {
    cache: HashMap<(String, u64), Option<Arc<CudaLibrary>>>,
}

impl Scanner {
    pub fn scan(&mut self, pid: u32) -> Result<Scan, LibraryError> {
        let mut scan = Scan::default();
        for mapped in mapped_files(pid)? {
            scan.searched.push(mapped.path.clone());
            let key = (mapped.dev.clone(), mapped.inode);
            let lib = match self.cache.get(&key) {
                Some(lib) => lib.clone(),
                None => {
                    let lib = match inspect(&mapped.path, &mapped.open_path) {
                        Ok(lib) => lib.map(Arc::new),
                        Err(e) => {
                            // A file we cannot open now (gone, permissions) is
                            // not remembered: a later scan tries again.
                            log::debug!("skipping {}: {e}", mapped.path.display());
                            if let LibraryError::Io(_, io) = &e
                                && io.kind() == std::io::ErrorKind::PermissionDenied
                            {
                                scan.denied.push(mapped.path.clone());
                            }
                            continue;
                        }
                    };
                    self.cache.insert(key, lib.clone());
                    lib
                }
            };
            if let Some(mut lib) = lib {
                // The file as this process sees it: the process that first
                // showed it to us may have exited (its /proc path is gone).
                if lib.open_path != mapped.open_path {
                    lib = Arc::new(CudaLibrary {
                        open_path: mapped.open_path.clone(),
                        ..(*lib).clone()
                    });
                }
                scan.libraries.push(lib);
            }
        }
        Ok(scan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_maps_lines() {
        let text = "\
55d0c0a00000-55d0c0a01000 r--p 00000000 fd:01 1234 /usr/bin/python3.11
55d0c0a01000-55d0c0a02000 r-xp 00001000 fd:01 1234 /usr/bin/python3.11
7f0000000000-7f0000001000 r-xp 00000000 fd:01 99 /opt/my lib/libcudart-4e0b8a1f.so.12
7f0000002000-7f0000003000 rw-p 00000000 00:00 0
7f0000004000-7f0000005000 r-xp 00000000 fd:01 77 /tmp/old.so (deleted)
7ffd00000000-7ffd00001000 r-xp 00000000 00:00 0                          [vdso]
";
        let files = parse_maps(42, text);
        assert_eq!(files.len(), 2);
        assert_eq!(files[0].path, PathBuf::from("/usr/bin/python3.11"));
        assert_eq!(
            files[0].open_path,
            PathBuf::from("/proc/42/root/usr/bin/python3.11")
        );
        assert_eq!(
            files[1].path,
            PathBuf::from("/opt/my lib/libcudart-4e0b8a1f.so.12")
        );
        assert_eq!((files[1].dev.as_str(), files[1].inode), ("fd:01", 99));
    }

    #[test]
    fn a_plain_binary_is_no_cuda_library() {
        let exe = std::env::current_exe().expect("test binary path");
        assert!(inspect(&exe, &exe).expect("readable").is_none());
        let not_elf = Path::new("/proc/self/status");
        assert!(matches!(inspect(not_elf, not_elf), Ok(None) | Err(_)));
    }

    #[test]
    fn missing_process_is_reported() {
        assert!(matches!(
            mapped_files(u32::MAX),
            Err(LibraryError::NoProcess(_))
        ));
    }
}
