//! tracefs: mounting it when missing, and reading tracepoint field offsets
//! from `format` files so that no kernel struct layout is hard-coded.

use std::{
    fs,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};
use thiserror::Error;

const TRACEFS: &str = "/sys/kernel/tracing";
const DEBUGFS_TRACING: &str = "/sys/kernel/debug/tracing";

#[derive(Debug, Error)]
pub enum TracefsError {
    #[error(
        "tracefs is not mounted and mounting it at {TRACEFS} failed ({0}); \
         mount it with `mount -t tracefs nodev {TRACEFS}`"
    )]
    Mount(std::io::Error),
    #[error(
        "tracefs at {0} is not readable by this process (it is mode 0700, owned by root): \
         run as root, or grant CAP_DAC_READ_SEARCH"
    )]
    Unreadable(String),
    #[error("tracepoint {0} not found in tracefs: this kernel lacks it ({1})")]
    NoTracepoint(String, std::io::Error),
    #[error("tracepoint {tracepoint} has no field `{field}` in its format file")]
    NoField { tracepoint: String, field: String },
    #[error("cannot parse the format file of {0}: {1}")]
    Parse(String, String),
    /// An error met reading tracefs earlier, kept as its text in a kernel
    /// description, and said again as it was.
    #[error("{0}")]
    Recorded(String),
}

/// The tracefs root, mounting it at /sys/kernel/tracing when neither it nor
/// the debugfs copy is there.
pub fn root() -> Result<PathBuf, TracefsError> {
    for dir in [TRACEFS, DEBUGFS_TRACING] {
        match fs::metadata(Path::new(dir).join("events")) {
            Ok(m) if m.is_dir() => return Ok(PathBuf::from(dir)),
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                return Err(TracefsError::Unreadable(dir.into()));
            }
            _ => {}
        }
    }
    mount_tracefs()?;
    Ok(PathBuf::from(TRACEFS))
}

fn mount_tracefs() -> Result<(), TracefsError> {
    let cstr = |s: &str| std::ffi::CString::new(s).expect("static string without NUL");
    let (src, target, fstype) = (cstr("nodev"), cstr(TRACEFS), cstr("tracefs"));
    // SAFETY: valid NUL-terminated strings; no data argument.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(TracefsError::Mount(std::io::Error::last_os_error()))
    }
}

/// The fields of one tracepoint's format file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Format {
    name: String,
    fields: Vec<(String, u32)>,
}

impl Format {
    /// Reads `events/<category>/<name>/format`.
    pub fn read(root: &Path, category: &str, name: &str) -> Result<Self, TracefsError> {
        let tp = format!("{category}:{name}");
        let path = root.join("events").join(category).join(name).join("format");
        let text =
            fs::read_to_string(&path).map_err(|e| TracefsError::NoTracepoint(tp.clone(), e))?;
        Self::parse(&tp, &text)
    }

    /// Parses the text of a format file (lines such as
    /// `field:pid_t child_pid;<TAB>offset:20;<TAB>size:4;<TAB>signed:1;`).
    pub fn parse(tracepoint: &str, text: &str) -> Result<Self, TracefsError> {
        let mut fields = Vec::new();
        for line in text.lines() {
            let line = line.trim();
            let Some(rest) = line.strip_prefix("field:") else {
                continue;
            };
            let mut decl = None;
            let mut offset = None;
            for part in rest.split(';') {
                let part = part.trim();
                if let Some(o) = part.strip_prefix("offset:") {
                    offset = o.parse::<u32>().ok();
                } else if decl.is_none() && !part.is_empty() {
                    decl = Some(part);
                }
            }
            let (Some(decl), Some(offset)) = (decl, offset) else {
                return Err(TracefsError::Parse(tracepoint.into(), line.into()));
            };
            // The name is the last word of the declaration, without any array
            // suffix: `char prev_comm[16]` -> `prev_comm`.
            let name = decl
                .rsplit(|c: char| c.is_whitespace() || c == '*')
                .next()
                .unwrap_or(decl);
            let name = name.split('[').next().unwrap_or(name);
            fields.push((name.to_string(), offset));
        }
        if fields.is_empty() {
            return Err(TracefsError::Parse(tracepoint.into(), "no fields".into()));
        }
        Ok(Self {
            name: tracepoint.into(),
            fields,
        })
    }

    /// Offset of a field, or an error naming it.
    pub fn offset(&self, field: &str) -> Result<u32, TracefsError> {
        self.optional_offset(field)
            .ok_or_else(|| TracefsError::NoField {
                tracepoint: self.name.clone(),
                field: field.into(),
            })
    }

    /// Offset of a field that older kernels may lack.
    pub fn optional_offset(&self, field: &str) -> Option<u32> {
        self.fields
            .iter()
            .find(|(n, _)| n == field)
            .map(|(_, o)| *o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORK: &str = "name: sched_process_fork
ID: 312
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:__data_loc char[] parent_comm;\toffset:8;\tsize:4;\tsigned:0;
\tfield:pid_t parent_pid;\toffset:12;\tsize:4;\tsigned:1;
\tfield:__data_loc char[] child_comm;\toffset:16;\tsize:4;\tsigned:0;
\tfield:pid_t child_pid;\toffset:20;\tsize:4;\tsigned:1;

print fmt: \"comm=%s pid=%d\", __get_str(parent_comm), REC->parent_pid
";

    #[test]
    fn parses_fields_and_offsets() {
        let f = Format::parse("sched:sched_process_fork", FORK).expect("parse");
        assert_eq!(f.offset("parent_pid").ok(), Some(12));
        assert_eq!(f.offset("child_pid").ok(), Some(20));
        assert_eq!(f.offset("parent_comm").ok(), Some(8));
        assert_eq!(f.offset("common_type").ok(), Some(0));
        assert!(f.optional_offset("group_dead").is_none());
        let err = f.offset("nope").expect_err("missing field");
        assert!(err.to_string().contains("sched:sched_process_fork"));
    }

    #[test]
    fn parses_arrays_and_pointers() {
        let text = "format:
\tfield:char prev_comm[16];\toffset:8;\tsize:16;\tsigned:0;
\tfield:const void * skaddr;\toffset:16;\tsize:8;\tsigned:0;
\tfield:bool group_dead;\toffset:32;\tsize:1;\tsigned:0;
";
        let f = Format::parse("x:y", text).expect("parse");
        assert_eq!(f.offset("prev_comm").ok(), Some(8));
        assert_eq!(f.offset("skaddr").ok(), Some(16));
        assert_eq!(f.offset("group_dead").ok(), Some(32));
    }

    #[test]
    fn rejects_garbage() {
        assert!(Format::parse("x:y", "nothing here").is_err());
        assert!(Format::parse("x:y", "field:int a;\tsize:4;").is_err());
    }
}
