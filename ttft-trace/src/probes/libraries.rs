//! Finding the CUDA runtime and driver code a process runs: every mapped ELF
//! file that defines the probed entry points, whatever it is called (a
//! versioned `libcudart.so.12`, a hashed copy inside a wheel, or an
//! extension module with the runtime linked in statically, whose symbols are
//! only in `.symtab`).

//!
//! The file inspected is the file mapped: it is opened through
//! `/proc/PID/map_files/<range>` (the mapping's own file, not a path that a
//! container could re-point), checked to be a regular file (a device such
//! as `/dev/nvidia0` is never opened) whose device and inode are those of
//! the maps entry, and read with plain reads under a budget (no shared
//! mapping that a truncation would turn into SIGBUS). The probes are then
//! attached through that same open file (`/proc/self/fd/N`).

use std::{
    collections::{BTreeSet, HashMap},
    fs::File,
    os::{
        fd::AsRawFd,
        unix::fs::{FileExt, MetadataExt},
    },
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use object::{Object, ObjectSegment, ObjectSymbol, ReadCache, ReadCacheOps, SymbolKind};
use thiserror::Error;

use super::symbols::{self, Api, MARKERS, ProbedSymbol};
use crate::host::rootfs::{self, RootfsError};

/// Most bytes of `/proc/PID/maps` read (a process with a hundred thousand
/// mappings; past that, the rest is not looked at).
const MAPS_MAX: u64 = 16 << 20;
/// Most bytes read of one ELF file: its headers and symbol tables, not its
/// code. A large `libtorch_cuda.so` has symbol tables of tens of MiB.
const ELF_READ_MAX: u64 = 256 << 20;
/// Most symbols looked at in one file (both tables).
const SYMBOLS_MAX: usize = 4_000_000;
/// Most files remembered by a [`Scanner`]; past that, what it remembers of
/// files that are no CUDA library (or failed) is forgotten.
const SCANNER_CACHE_MAX: usize = 65_536;

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
}

impl LibraryError {
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
            LibraryError::NoProcess(_) => true,
            LibraryError::File(RootfsError::Open { source, .. }) => {
                source.kind() == std::io::ErrorKind::NotFound
            }
            _ => false,
        }
    }
}

/// A file-backed mapping of a process, as listed in `/proc/PID/maps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MappedFile {
    /// The path as the process sees it.
    pub path: PathBuf,
    /// The mapping's own file: `/proc/PID/map_files/<start>-<end>` of its
    /// first mapping.
    pub map_file: PathBuf,
    /// Device (as `st_dev` has it) and inode of the mapped file.
    pub dev: u64,
    pub inode: u64,
}

/// The distinct files mapped by `pid`.
pub fn mapped_files(pid: u32) -> Result<Vec<MappedFile>, LibraryError> {
    let maps = format!("/proc/{pid}/maps");
    let text = match rootfs::read_proc(Path::new(&maps), MAPS_MAX) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(LibraryError::NoProcess(pid));
        }
        Err(e) => return Err(LibraryError::Io(maps.into(), e)),
    };
    // A capped read may end inside a line: only whole lines count.
    let whole = text
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(&text[..0], |i| &text[..=i]);
    Ok(parse_maps(pid, &String::from_utf8_lossy(whole)))
}

/// `st_dev` of a maps device field (`major:minor` in hex).
fn parse_dev(field: &str) -> Option<u64> {
    let (major, minor) = field.split_once(':')?;
    let major = u32::from_str_radix(major, 16).ok()?;
    let minor = u32::from_str_radix(minor, 16).ok()?;
    Some(libc::makedev(major, minor))
}

pub fn parse_maps(pid: u32, text: &str) -> Vec<MappedFile> {
    let mut seen = BTreeSet::new();
    let mut files = Vec::new();
    for line in text.lines() {
        // addr perms offset dev inode path (the path may contain spaces)
        let mut parts = line.splitn(6, ' ');
        let (Some(range), Some(_), Some(_), Some(dev), Some(inode), Some(path)) = (
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
        let (Ok(inode), Some(dev)) = (inode.parse::<u64>(), parse_dev(dev)) else {
            continue;
        };
        if inode == 0 || !path.starts_with('/') || path.ends_with(" (deleted)") {
            continue;
        }
        if !seen.insert((dev, inode)) {
            continue;
        }
        files.push(MappedFile {
            path: PathBuf::from(path),
            map_file: PathBuf::from(format!("/proc/{pid}/map_files/{range}")),
            dev,
            inode,
        });
    }
    files
}

/// What a uprobe lands on: the kernel attaches it to the real inode (under
/// an overlay, the layer's), which `/proc/PID/maps` does not show (it
/// shows the overlay's device). The file system's handle of the inode
/// names it (an overlay's handle wraps the layer's, unwrapped here), so
/// one file seen through several overlays or mount namespaces is one key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FileId {
    /// The real inode's handle type and bytes, with the file's size (two
    /// file systems may hand out equal handles; two such files of the same
    /// size too would be taken for one).
    Handle {
        kind: i32,
        bytes: Vec<u8>,
        size: u64,
    },
    /// Device and inode, where the file system gives no handle.
    Inode { dev: u64, ino: u64 },
}

/// Handle type of an overlay's handles (`OVL_FILEID_V1`), and the layout
/// of what follows: 3 bytes of padding, then version, magic `0xfb`,
/// length, flags, the real handle's type, a 16-byte uuid, the real handle.
const OVL_FILEID_V1: i32 = 0xf8;
const OVL_FB_MAGIC: u8 = 0xfb;
const OVL_FB_REAL_TYPE: usize = 7;
const OVL_FB_REAL_HANDLE: usize = 24;
/// `AT_HANDLE_FID` (Linux 6.5): a handle to identify, not to reopen, which
/// every file system gives.
const AT_HANDLE_FID: libc::c_int = 0x200;
const MAX_HANDLE_SZ: usize = 128;

#[repr(C)]
struct FileHandle {
    handle_bytes: u32,
    handle_type: libc::c_int,
    f_handle: [u8; MAX_HANDLE_SZ],
}

impl FileId {
    /// The identity of an open file.
    pub fn of(file: &File) -> std::io::Result<Self> {
        let meta = file.metadata()?;
        let mut h = FileHandle {
            handle_bytes: MAX_HANDLE_SZ as u32,
            handle_type: 0,
            f_handle: [0; MAX_HANDLE_SZ],
        };
        let mut mount_id: libc::c_int = 0;
        // SAFETY: a valid fd, an empty NUL-terminated path with
        // AT_EMPTY_PATH, a handle buffer of the size it declares, and a
        // valid mount id pointer; the result is checked.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_name_to_handle_at,
                file.as_raw_fd(),
                c"".as_ptr(),
                &mut h as *mut FileHandle,
                &mut mount_id as *mut libc::c_int,
                libc::AT_EMPTY_PATH | AT_HANDLE_FID,
            )
        };
        let len = (h.handle_bytes as usize).min(MAX_HANDLE_SZ);
        if rc != 0 || len == 0 {
            return Ok(FileId::Inode {
                dev: meta.dev(),
                ino: meta.ino(),
            });
        }
        Ok(Self::from_handle(
            h.handle_type,
            &h.f_handle[..len],
            meta.len(),
        ))
    }

    fn from_handle(kind: i32, bytes: &[u8], size: u64) -> Self {
        if kind == OVL_FILEID_V1
            && bytes.len() > OVL_FB_REAL_HANDLE
            && bytes.get(4) == Some(&OVL_FB_MAGIC)
        {
            return FileId::Handle {
                kind: i32::from(bytes[OVL_FB_REAL_TYPE]),
                bytes: bytes[OVL_FB_REAL_HANDLE..].to_vec(),
                size,
            };
        }
        FileId::Handle {
            kind,
            bytes: bytes.to_vec(),
            size,
        }
    }
}

/// A file that defines CUDA entry points, with the file offset of each.
#[derive(Debug, Clone)]
pub struct CudaLibrary {
    /// The path as the process that showed it sees it (for messages).
    pub path: PathBuf,
    /// The file inspected, kept open: the probes attach through it.
    pub file: Arc<File>,
    /// `/proc/self/fd/N` of [`CudaLibrary::file`]: the path to attach by.
    pub open_path: PathBuf,
    /// Which file the probes land on.
    pub id: FileId,
    pub apis: BTreeSet<Api>,
    /// Probed symbols and their file offsets (one symbol may appear at more
    /// than one offset when several versions are defined).
    pub symbols: Vec<(&'static ProbedSymbol, u64)>,
}

/// Reads an ELF file of the daemon's own namespace (a library the user
/// named; `path` for messages, opened at `open_path`) and returns the CUDA
/// entry points it defines, or None when it is no CUDA library. Files that
/// are not ELF are None, not errors.
pub fn inspect(path: &Path, open_path: &Path) -> Result<Option<CudaLibrary>, LibraryError> {
    let file = rootfs::open_regular_file(open_path)?;
    inspect_file(path, file)
}

/// The mapped file of `mapped`, opened and checked to be it.
fn open_mapped(mapped: &MappedFile) -> Result<File, LibraryError> {
    let file = rootfs::open_regular_file(&mapped.map_file)?;
    let meta = file
        .metadata()
        .map_err(|e| LibraryError::Io(mapped.map_file.clone(), e))?;
    if (meta.dev(), meta.ino()) != (mapped.dev, mapped.inode) {
        return Err(LibraryError::NotTheMappedFile {
            path: mapped.path.clone(),
            dev: mapped.dev,
            ino: mapped.inode,
            found_dev: meta.dev(),
            found_ino: meta.ino(),
        });
    }
    Ok(file)
}

/// An open file read at offsets (pread: no shared file position, no
/// mapping), at most `budget` bytes in all.
struct Budgeted<'a> {
    file: &'a File,
    len: u64,
    pos: u64,
    budget: u64,
    exhausted: bool,
}

impl ReadCacheOps for Budgeted<'_> {
    fn len(&mut self) -> Result<u64, ()> {
        Ok(self.len)
    }

    fn seek(&mut self, pos: u64) -> Result<u64, ()> {
        self.pos = pos;
        Ok(pos)
    }

    fn read(&mut self, buf: &mut [u8]) -> Result<usize, ()> {
        let want = (buf.len() as u64).min(self.budget);
        if want == 0 && !buf.is_empty() {
            self.exhausted = true;
            return Err(());
        }
        let n = self
            .file
            .read_at(&mut buf[..want as usize], self.pos)
            .map_err(|_| ())?;
        self.pos += n as u64;
        self.budget -= n as u64;
        Ok(n)
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), ()> {
        if buf.len() as u64 > self.budget {
            self.exhausted = true;
            return Err(());
        }
        self.file.read_exact_at(buf, self.pos).map_err(|_| ())?;
        self.pos += buf.len() as u64;
        self.budget -= buf.len() as u64;
        Ok(())
    }
}

/// [`inspect`] of a file already open (and checked to be regular).
fn inspect_file(path: &Path, file: File) -> Result<Option<CudaLibrary>, LibraryError> {
    inspect_budgeted(path, file, ELF_READ_MAX)
}

/// [`inspect_file`], reading at most `budget` bytes.
fn inspect_budgeted(
    path: &Path,
    file: File,
    budget: u64,
) -> Result<Option<CudaLibrary>, LibraryError> {
    let len = file
        .metadata()
        .map_err(|e| LibraryError::Io(path.into(), e))?
        .len();
    let cache = ReadCache::new(Budgeted {
        file: &file,
        len,
        pos: 0,
        budget,
        exhausted: false,
    });
    let found = {
        let Ok(elf) = object::File::parse(&cache) else {
            // Section headers past the budget read as no ELF file.
            if cache.into_inner().exhausted {
                return Err(LibraryError::TooLarge(path.into()));
            }
            return Ok(None);
        };
        let mut found: Vec<(&'static ProbedSymbol, u64)> = Vec::new();
        for (n, sym) in elf.dynamic_symbols().chain(elf.symbols()).enumerate() {
            if n >= SYMBOLS_MAX {
                return Err(LibraryError::TooLarge(path.into()));
            }
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
        found
    };
    // A symbol table cut short by the budget reads as an empty one: say so
    // rather than call the file no CUDA library.
    if cache.into_inner().exhausted {
        return Err(LibraryError::TooLarge(path.into()));
    }
    let mut found = found;
    if !found.iter().any(|(s, _)| MARKERS.contains(&s.name)) {
        return Ok(None);
    }
    let apis = found.iter().map(|(s, _)| s.api).collect();
    // The order they are attached in: launches last ([`ProbedSymbol::is_launch`]).
    found.sort_by_key(|(s, o)| (s.is_launch(), s.name, *o));
    let id = FileId::of(&file).map_err(|e| LibraryError::Io(path.into(), e))?;
    let open_path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
    Ok(Some(CudaLibrary {
        path: path.into(),
        file: Arc::new(file),
        open_path,
        id,
        apis,
        symbols: found,
    }))
}

/// Converts a virtual address to the file offset a uprobe wants, through the
/// loadable segment that holds it.
fn file_offset<'d, R: object::ReadRef<'d>>(elf: &object::File<'d, R>, addr: u64) -> Option<u64> {
    // The header's values are the file owner's: a segment that wraps the
    // address space is no segment (found by the elf_files fuzz target).
    elf.segments().find_map(|seg| {
        let (offset, size) = seg.file_range();
        let start = seg.address();
        let end = start.checked_add(size)?;
        if addr < start || addr >= end {
            return None;
        }
        (addr - start).checked_add(offset)
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

/// What a file turned out to be.
#[derive(Debug, Clone)]
enum Seen {
    Library(Arc<CudaLibrary>),
    /// No CUDA library, or a file that cannot be inspected (not regular,
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

    pub fn scan(&mut self, pid: u32) -> Result<Scan, LibraryError> {
        let mut scan = Scan::default();
        for mapped in mapped_files(pid)? {
            scan.searched.push(mapped.path.clone());
            let key = (mapped.dev, mapped.inode);
            let seen = match self.cache.get(&key) {
                Some(seen) => seen.clone(),
                None => {
                    let seen = match open_mapped(&mapped)
                        .and_then(|file| inspect_file(&mapped.path, file))
                    {
                        Ok(Some(lib)) => Seen::Library(Arc::new(lib)),
                        Ok(None) => Seen::Other,
                        // The process exited or unmapped it meanwhile: a
                        // later scan tries again.
                        Err(e) if e.is_transient() => continue,
                        Err(e) => {
                            log::debug!("not inspecting {}: {e}", mapped.path.display());
                            if e.is_permission() {
                                Seen::Denied
                            } else {
                                Seen::Other
                            }
                        }
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
7f0000006000-7f0000007000 rw-s 00000000 00:05 401 /dev/nvidiactl
7ffd00000000-7ffd00001000 r-xp 00000000 00:00 0                          [vdso]
";
        let files = parse_maps(42, text);
        assert_eq!(files.len(), 3);
        assert_eq!(files[0].path, PathBuf::from("/usr/bin/python3.11"));
        assert_eq!(
            files[0].map_file,
            PathBuf::from("/proc/42/map_files/55d0c0a00000-55d0c0a01000")
        );
        assert_eq!(
            files[1].path,
            PathBuf::from("/opt/my lib/libcudart-4e0b8a1f.so.12")
        );
        assert_eq!((files[1].dev, files[1].inode), (libc::makedev(0xfd, 1), 99));
        assert_eq!(files[2].path, PathBuf::from("/dev/nvidiactl"));
    }

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

    #[test]
    fn our_own_mappings_are_opened_as_mapped_and_remembered() {
        let me = std::process::id();
        let files = mapped_files(me).expect("own maps");
        let exe = std::env::current_exe()
            .expect("exe")
            .canonicalize()
            .expect("path");
        let own = files
            .iter()
            .find(|f| f.path == exe)
            .expect("the test binary is mapped");
        let file = open_mapped(own).expect("open through map_files");
        let meta = file.metadata().expect("stat");
        assert_eq!((meta.dev(), meta.ino()), (own.dev, own.inode));
        // A maps entry whose device and inode are another file's is refused.
        let wrong = MappedFile {
            inode: own.inode + 1,
            ..own.clone()
        };
        assert!(matches!(
            open_mapped(&wrong),
            Err(LibraryError::NotTheMappedFile { .. })
        ));
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
            Seen::Library(Arc::new(CudaLibrary {
                path: exe.clone(),
                file: file.clone(),
                open_path: exe.clone(),
                id: FileId::Inode { dev: 1, ino },
                apis: BTreeSet::new(),
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

    #[test]
    fn the_read_budget_is_enforced() {
        let exe = std::env::current_exe().expect("test binary path");
        let file = rootfs::open_regular_file(&exe).expect("open");
        let len = file.metadata().expect("stat").len();
        let mut b = Budgeted {
            file: &file,
            len,
            pos: 0,
            budget: 16,
            exhausted: false,
        };
        let mut buf = [0u8; 8];
        assert!(b.read_exact(&mut buf).is_ok());
        assert_eq!(&buf[..4], b"\x7fELF");
        assert!(b.read_exact(&mut [0u8; 9]).is_err());
        assert!(b.exhausted);
        // A file whose headers and symbols do not fit is too large, not
        // "no CUDA library": both at the headers and at the symbol tables.
        for budget in [64, 64 << 10] {
            let file = rootfs::open_regular_file(&exe).expect("open");
            assert!(
                matches!(
                    inspect_budgeted(&exe, file, budget),
                    Err(LibraryError::TooLarge(_))
                ),
                "{budget}"
            );
        }
    }

    #[test]
    fn overlay_handles_name_the_layer_file() {
        // As measured on Linux 6.18: the file's own handle, and the handle
        // of the same file seen through an overlay.
        let real = [0x6e, 0x41, 0x53, 0x00, 0xf0, 0x7b, 0x2c, 0xec];
        let mut ovl = vec![0, 0, 0, 0, 0xfb, 0x1d, 0, 1];
        ovl.extend([0u8; 16]);
        ovl.extend(real);
        assert_eq!(
            FileId::from_handle(OVL_FILEID_V1, &ovl, 10),
            FileId::from_handle(1, &real, 10)
        );
        assert_ne!(
            FileId::from_handle(1, &real, 10),
            FileId::from_handle(1, &real, 11)
        );
    }

    #[test]
    fn missing_process_is_reported() {
        assert!(matches!(
            mapped_files(u32::MAX),
            Err(LibraryError::NoProcess(_))
        ));
    }
}
