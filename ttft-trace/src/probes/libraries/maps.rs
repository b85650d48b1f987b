//! The files a process maps, as `/proc/PID/maps` lists them, and opening
//! one as the mapping's own file.

use std::{
    collections::BTreeSet,
    fs::File,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use super::LibraryError;
use crate::host::rootfs;

/// Most bytes of `/proc/PID/maps` read (a process with a hundred thousand
/// mappings; past that, the rest is not looked at).
const MAPS_MAX: u64 = 16 << 20;

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

/// The mapped file of `mapped`, opened and checked to be it.
pub(super) fn open_mapped(mapped: &MappedFile) -> Result<File, LibraryError> {
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
    fn our_own_mappings_are_opened_as_mapped() {
        if !crate::test_support::root_or_skip("our_own_mappings_are_opened_as_mapped") {
            return;
        }
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
    }

    #[test]
    fn missing_process_is_reported() {
        assert!(matches!(
            mapped_files(u32::MAX),
            Err(LibraryError::NoProcess(_))
        ));
    }
}
