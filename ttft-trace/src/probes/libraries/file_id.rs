//! Which file a uprobe lands on, however many mount namespaces or
//! overlays show it.

use std::{
    fs::File,
    os::{fd::AsRawFd, unix::fs::MetadataExt},
};

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
