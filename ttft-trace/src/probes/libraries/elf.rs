//! Reading an ELF file's symbol tables for the probed functions, with
//! plain reads under a budget.

use std::{
    collections::{HashMap, HashSet},
    fs::File,
    os::{fd::AsRawFd, unix::fs::FileExt},
    path::{Path, PathBuf},
    sync::Arc,
};

use object::{
    Object, ObjectSegment, ObjectSymbol, ReadCache, ReadCacheOps, SymbolKind, SymbolScope,
};

use super::{
    FileId, Library, LibraryError,
    tls::{TlsLibrary, TlsMarks},
};
use crate::host::deadline;
use crate::probes::{
    openssl,
    symbols::{self, FAMILIES, Family, ProbedSymbol, TLS_FAMILIES},
};

/// Most bytes read of one ELF file: its headers and symbol tables, not its
/// code. A large `libtorch_cuda.so` has symbol tables of tens of MiB.
pub(super) const ELF_READ_MAX: u64 = 256 << 20;
/// Most symbols looked at in one file (both tables).
pub(super) const SYMBOLS_MAX: usize = 4_000_000;
/// Most other addresses one probed name may have in a file beyond the one
/// probed (both tables). A real library defines each function once (a
/// static copy may add a local one); a file with thousands of copies of
/// `cudaLaunchKernel` would cost the host one uprobe per copy, and the
/// kernel removes uprobes one by one (issue 28).
pub(super) const COPIES_MAX: usize = 16;

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
        deadline::progress();
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
        deadline::progress();
        Ok(())
    }
}

/// What an ELF file is to the tracer: a library to probe, and the TLS
/// library it carries (either, both or neither), with the probes that read
/// its plaintext where it is one read ([`symbols::TLS_FAMILIES`]).
#[derive(Debug, Default)]
pub(super) struct Inspected {
    pub library: Option<Library>,
    pub tls: Option<TlsLibrary>,
    pub tls_probes: Option<Library>,
}

/// [`super::inspect`] of a file already open (and checked to be regular).
pub(super) fn inspect_file(path: &Path, file: File) -> Result<Inspected, LibraryError> {
    inspect_budgeted(path, file, ELF_READ_MAX)
}

/// A probed function found in a file, at a file offset.
type Found = (&'static Family, &'static ProbedSymbol, u64);

/// [`inspect_file`], reading at most `budget` bytes.
fn inspect_budgeted(path: &Path, file: File, budget: u64) -> Result<Inspected, LibraryError> {
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
    let parsed = object::File::parse(&cache).map(|elf| probed_symbols(&elf, path));
    let (found, tls) = match parsed {
        Ok(found) => found?,
        // Section headers past the budget read as no ELF file.
        Err(_) if cache.into_inner().exhausted => return Err(LibraryError::TooLarge(path.into())),
        Err(_) => return Ok(Inspected::default()),
    };
    let (marks, tls) = (tls, tls.library());
    // A symbol table cut short by the budget reads as an empty one: say so
    // rather than call the file no library to probe.
    if cache.into_inner().exhausted {
        return Err(LibraryError::TooLarge(path.into()));
    }
    let (tls_found, found): (Vec<Found>, Vec<Found>) = found
        .into_iter()
        .partition(|(f, _, _)| TLS_FAMILIES.contains(f));
    let cuda = found.iter().any(|(_, s, _)| symbols::is_marker(s.name));
    // Only OpenSSL's own `SSL_write` is read: a compatibility layer's or
    // BoringSSL's is named, not probed; and only OpenSSL's `BIO_write`.
    let ours = |f: &Family| {
        if *f == openssl::OPENSSL_BIO {
            marks.openssl_crypto()
        } else {
            tls == Some(TlsLibrary::OpenSsl)
        }
    };
    let tls_found: Vec<Found> = tls_found.into_iter().filter(|(f, _, _)| ours(f)).collect();
    let read_tls = tls_found
        .iter()
        .any(|(f, s, _)| f.markers.contains(&s.name));
    if !cuda && !read_tls {
        return Ok(Inspected {
            tls,
            ..Inspected::default()
        });
    }
    let id = FileId::of(&file).map_err(|e| LibraryError::Io(path.into(), e))?;
    let open_path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
    let file = Arc::new(file);
    let library_of = |found: Vec<Found>, families: &[&'static Family]| Library {
        path: path.into(),
        file: file.clone(),
        open_path: open_path.clone(),
        id: id.clone(),
        apis: families
            .iter()
            .copied()
            .filter(|f| found.iter().any(|(of, _, _)| of == f))
            .collect(),
        symbols: attach_order(found),
        tls,
    };
    Ok(Inspected {
        library: cuda.then(|| library_of(found, FAMILIES)),
        tls,
        tls_probes: read_tls.then(|| library_of(tls_found, TLS_FAMILIES)),
    })
}

/// The probed functions an ELF file defines (both symbol tables), each name
/// at one file offset: the first seen, the dynamic table's, which callers
/// resolve to; and the marks of a TLS library among its functions. Linear
/// in the symbols read; a name with more than [`COPIES_MAX`] other
/// addresses refuses the file.
fn probed_symbols<'d, R: object::ReadRef<'d>>(
    elf: &object::File<'d, R>,
    path: &Path,
) -> Result<(Vec<Found>, TlsMarks), LibraryError> {
    let mut tls = TlsMarks::default();
    let mut first: HashMap<&'static str, Found> = HashMap::new();
    let mut seen: HashSet<(&'static str, u64)> = HashSet::new();
    let mut copies: HashMap<&'static str, usize> = HashMap::new();
    for (n, sym) in elf.dynamic_symbols().chain(elf.symbols()).enumerate() {
        if n >= SYMBOLS_MAX {
            return Err(LibraryError::TooLarge(path.into()));
        }
        if !sym.is_definition() || sym.kind() != SymbolKind::Text {
            continue;
        }
        let Ok(name) = sym.name() else {
            continue;
        };
        tls.see(name, sym.scope() == SymbolScope::Dynamic);
        let Some((family, probed)) = symbols::lookup(name) else {
            continue;
        };
        let Some(offset) = file_offset(elf, sym.address()) else {
            continue;
        };
        if !seen.insert((probed.name, offset)) {
            continue;
        }
        if first.contains_key(probed.name) {
            let n = copies.entry(probed.name).or_default();
            *n += 1;
            if *n > COPIES_MAX {
                return Err(LibraryError::TooManyCopies {
                    path: path.into(),
                    name: probed.name,
                });
            }
            continue;
        }
        first.insert(probed.name, (family, probed, offset));
    }
    Ok((first.into_values().collect(), tls))
}

/// The order a file's probes are attached in: role by role
/// ([`super::super::symbols::Role`]: the calls that open work last), then
/// by name and offset.
fn attach_order(mut found: Vec<Found>) -> Vec<(&'static ProbedSymbol, u64)> {
    found.sort_by_key(|(_, s, o)| (s.role, s.name, *o));
    found.into_iter().map(|(_, s, o)| (s, o)).collect()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        host::rootfs,
        probes::openssl::{OPENSSL, OPENSSL_BIO},
    };

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

    /// This machine's OpenSSL 3 (Debian 12): `libssl` is probed for its TLS
    /// calls, `libcrypto` for its record writes (a memory BIO's binding),
    /// neither as a CUDA library.
    #[test]
    fn system_openssl_is_probed_in_both_files() {
        let dir = Path::new("/usr/lib/x86_64-linux-gnu");
        let cases = [
            ("libssl.so.3", "SSL_write", Some(TlsLibrary::OpenSsl)),
            ("libcrypto.so.3", "BIO_write", None),
        ];
        for (file, probed, tls) in cases {
            let path = dir.join(file);
            let Ok(opened) = rootfs::open_regular_file(&path) else {
                eprintln!("{} absent here: not checked", path.display());
                continue;
            };
            let got = inspect_file(&path, opened).expect("inspect");
            assert!(got.library.is_none(), "{file}");
            assert_eq!(got.tls, tls, "{file}");
            let probes = got.tls_probes.expect("probes");
            assert!(
                probes.symbols.iter().any(|(s, _)| s.name == probed),
                "{file}: {:?}",
                probes.symbols
            );
            // Less the record writes' table (probed only once a memory BIO
            // shows), `libssl`'s calls stay and `libcrypto` has none: a
            // binary with both linked in is probed for its TLS calls at once.
            let first = probes.without(&OPENSSL_BIO);
            assert!(first.symbols.iter().all(|(s, _)| !OPENSSL_BIO.owns(s)));
            assert_eq!(first.is(&OPENSSL), probes.is(&OPENSSL), "{file}");
            assert_eq!(first.symbols.is_empty(), tls.is_none(), "{file}");
        }
    }
}
