//! The BTF file itself: its header, type records and strings, and the
//! queries the layout readers ask of it (a struct member's offset and size,
//! an enumerator's value, a tracepoint's prototype).

use std::path::Path;

use super::{BtfError, Layouts};

pub const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

pub(super) const MAGIC: u16 = 0xeb9f;
/// The BTF file a kernel exports is a few MiB; anything far larger is not one.
const MAX_BYTES: u64 = 256 << 20;

pub(super) const KIND_INT: u32 = 1;
pub(super) const KIND_PTR: u32 = 2;
pub(super) const KIND_ARRAY: u32 = 3;
pub(super) const KIND_STRUCT: u32 = 4;
pub(super) const KIND_UNION: u32 = 5;
pub(super) const KIND_ENUM: u32 = 6;
pub(super) const KIND_TYPEDEF: u32 = 8;
pub(super) const KIND_VOLATILE: u32 = 9;
pub(super) const KIND_CONST: u32 = 10;
pub(super) const KIND_RESTRICT: u32 = 11;
pub(super) const KIND_FUNC_PROTO: u32 = 13;
pub(super) const KIND_VAR: u32 = 14;
pub(super) const KIND_DATASEC: u32 = 15;
pub(super) const KIND_DECL_TAG: u32 = 17;
pub(super) const KIND_TYPE_TAG: u32 = 18;
pub(super) const KIND_ENUM64: u32 = 19;

/// One type record: where its kind-specific trailer starts in the type section.
#[derive(Debug, Clone, Copy)]
struct Type {
    name_off: u32,
    kind: u32,
    vlen: u32,
    kind_flag: bool,
    size_or_type: u32,
    /// Byte offset of the trailer in the type section.
    extra: usize,
}

/// Parsed BTF: type records indexed by id (id 0 is `void`).
pub struct Btf {
    types_data: Vec<u8>,
    strings: Vec<u8>,
    types: Vec<Type>,
}

fn u32_at(data: &[u8], at: usize) -> Result<u32, BtfError> {
    data.get(at..at + 4)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or(BtfError::Format("truncated"))
}

impl Btf {
    /// Reads the running kernel's BTF.
    pub fn vmlinux() -> Result<Self, BtfError> {
        Self::read(Path::new(VMLINUX))
    }

    pub fn read(path: &Path) -> Result<Self, BtfError> {
        use std::io::Read as _;
        let err = |e| BtfError::Read(path.display().to_string(), e);
        let mut data = Vec::new();
        std::fs::File::open(path)
            .map_err(err)?
            .take(MAX_BYTES)
            .read_to_end(&mut data)
            .map_err(err)?;
        Self::parse(&data)
    }

    /// Parses a little-endian BTF blob (the only byte order of the kernels
    /// this tracer supports: x86_64 and aarch64).
    pub fn parse(data: &[u8]) -> Result<Self, BtfError> {
        if data.len() < 24 || u16::from_le_bytes([data[0], data[1]]) != MAGIC {
            return Err(BtfError::Format("bad magic (or not little-endian)"));
        }
        let hdr_len = u32_at(data, 4)? as usize;
        let field = |i: usize| u32_at(data, 8 + 4 * i).map(|v| v as usize);
        let (type_off, type_len, str_off, str_len) = (field(0)?, field(1)?, field(2)?, field(3)?);
        let section = |off: usize, len: usize| {
            let start = hdr_len
                .checked_add(off)
                .ok_or(BtfError::Format("section offset"))?;
            data.get(start..start.saturating_add(len))
                .ok_or(BtfError::Format("section past the end"))
        };
        let types_data = section(type_off, type_len)?.to_vec();
        let strings = section(str_off, str_len)?.to_vec();
        let mut types = vec![Type {
            name_off: 0,
            kind: 0,
            vlen: 0,
            kind_flag: false,
            size_or_type: 0,
            extra: 0,
        }];
        let mut at = 0;
        while at < types_data.len() {
            let info = u32_at(&types_data, at + 4)?;
            let t = Type {
                name_off: u32_at(&types_data, at)?,
                kind: (info >> 24) & 0x1f,
                vlen: info & 0xffff,
                kind_flag: info >> 31 == 1,
                size_or_type: u32_at(&types_data, at + 8)?,
                extra: at + 12,
            };
            let vlen = t.vlen as usize;
            let trailer = match t.kind {
                KIND_INT | KIND_VAR | KIND_DECL_TAG => 4,
                KIND_ARRAY => 12,
                KIND_STRUCT | KIND_UNION | KIND_DATASEC | KIND_ENUM64 => 12 * vlen,
                KIND_ENUM | KIND_FUNC_PROTO => 8 * vlen,
                0..=19 => 0,
                _ => return Err(BtfError::Format("unknown type kind")),
            };
            types.push(t);
            at = t.extra + trailer;
        }
        Ok(Self {
            types_data,
            strings,
            types,
        })
    }

    fn name(&self, t: &Type) -> &str {
        self.string(t.name_off)
    }

    fn string(&self, off: u32) -> &str {
        let start = off as usize;
        let Some(rest) = self.strings.get(start..) else {
            return "";
        };
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        std::str::from_utf8(&rest[..end]).unwrap_or("")
    }

    fn get(&self, id: u32) -> Result<&Type, BtfError> {
        self.types
            .get(id as usize)
            .ok_or_else(|| BtfError::Unexpected(format!("type id {id} out of range")))
    }

    fn find(&self, kind: u32, name: &str) -> Result<u32, BtfError> {
        self.types
            .iter()
            .position(|t| t.kind == kind && self.name(t) == name)
            .map(|i| i as u32)
            .ok_or_else(|| BtfError::Missing(name.to_string()))
    }

    /// Follows typedefs and qualifiers to the type they name.
    fn strip(&self, mut id: u32) -> Result<u32, BtfError> {
        // A chain longer than this is a loop in a corrupt file.
        for _ in 0..32 {
            let t = self.get(id)?;
            match t.kind {
                KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG => {
                    id = t.size_or_type;
                }
                _ => return Ok(id),
            }
        }
        Err(BtfError::Unexpected("typedef chain too long".into()))
    }

    /// (name, type id, bit offset) of each member of a struct or union.
    fn members(&self, id: u32) -> Result<Vec<(&str, u32, u32)>, BtfError> {
        let t = *self.get(id)?;
        if t.kind != KIND_STRUCT && t.kind != KIND_UNION {
            return Err(BtfError::Unexpected(format!(
                "type {} is not a struct",
                self.name(&t)
            )));
        }
        (0..t.vlen as usize)
            .map(|i| {
                let at = t.extra + 12 * i;
                let name_off = u32_at(&self.types_data, at)?;
                let ty = u32_at(&self.types_data, at + 4)?;
                let off = u32_at(&self.types_data, at + 8)?;
                // With kind_flag the high byte is a bitfield size.
                let bits = if t.kind_flag { off & 0x00ff_ffff } else { off };
                let name = self.string(name_off);
                Ok((name, ty, bits))
            })
            .collect()
    }

    /// Byte offset and type of `member` in a struct or union, looking into
    /// anonymous struct and union members as C does.
    fn member_in(&self, id: u32, member: &str, depth: u32) -> Result<Option<(u32, u32)>, BtfError> {
        if depth > 8 {
            return Ok(None);
        }
        for (name, ty, bits) in self.members(id)? {
            if name == member {
                if bits % 8 != 0 {
                    return Err(BtfError::Unexpected(format!("{member} is a bitfield")));
                }
                return Ok(Some((bits / 8, ty)));
            }
            if name.is_empty() {
                let inner = self.strip(ty)?;
                if let Some((off, t)) = self.member_in(inner, member, depth + 1)? {
                    return Ok(Some((bits / 8 + off, t)));
                }
            }
        }
        Ok(None)
    }

    fn size(&self, id: u32) -> Result<u32, BtfError> {
        self.size_at(id, 0)
    }

    /// `depth`: arrays of arrays followed so far (a malformed loop ends).
    fn size_at(&self, id: u32, depth: u32) -> Result<u32, BtfError> {
        if depth > 8 {
            return Err(BtfError::Unexpected("arrays nested too deep".into()));
        }
        let t = self.get(self.strip(id)?)?;
        match t.kind {
            KIND_INT | KIND_STRUCT | KIND_UNION | KIND_ENUM | KIND_ENUM64 => Ok(t.size_or_type),
            KIND_PTR => Ok(8),
            // `struct btf_array { type, index_type, nelems }` follows.
            KIND_ARRAY => {
                let elem = u32_at(&self.types_data, t.extra)?;
                let count = u32_at(&self.types_data, t.extra + 8)?;
                self.size_at(elem, depth + 1)?
                    .checked_mul(count)
                    .ok_or_else(|| BtfError::Unexpected("array size overflows".into()))
            }
            k => Err(BtfError::Unexpected(format!("size of a type of kind {k}"))),
        }
    }
}

impl Layouts for Btf {
    fn member(&self, strukt: &str, member: &str) -> Result<(u32, u32), BtfError> {
        let id = self.find(KIND_STRUCT, strukt)?;
        let (off, ty) = self
            .member_in(id, member, 0)?
            .ok_or_else(|| BtfError::Missing(format!("member {member} of struct {strukt}")))?;
        Ok((off, self.size(ty)?))
    }

    fn struct_size(&self, strukt: &str) -> Result<u32, BtfError> {
        self.size(self.find(KIND_STRUCT, strukt)?)
    }

    /// The value of enumerator `name` of `enum ty`.
    fn enum_value(&self, ty: &str, name: &str) -> Result<u64, BtfError> {
        let enum32 = self.find(KIND_ENUM, ty);
        let (id, entry) = match enum32 {
            Ok(id) => (id, 8),
            Err(_) => (self.find(KIND_ENUM64, ty)?, 12),
        };
        let t = *self.get(id)?;
        for i in 0..t.vlen as usize {
            let at = t.extra + entry * i;
            let name_off = u32_at(&self.types_data, at)?;
            if self.string(name_off) == name {
                let lo = u64::from(u32_at(&self.types_data, at + 4)?);
                let hi = if entry == 12 {
                    u64::from(u32_at(&self.types_data, at + 8)?)
                } else {
                    0
                };
                return Ok(hi << 32 | lo);
            }
        }
        Err(BtfError::Missing(format!("{name} in enum {ty}")))
    }

    /// What each argument of a tracepoint's `TP_PROTO` points to (a struct
    /// name, or "" for anything else). The kernel describes the prototype as
    /// `typedef void (*btf_trace_NAME)(void *ctx, args...)`; the leading
    /// context pointer is not an argument a raw tracepoint program sees.
    fn tracepoint_args(&self, tracepoint: &str) -> Result<Vec<String>, BtfError> {
        let typedef = self.find(KIND_TYPEDEF, &format!("btf_trace_{tracepoint}"))?;
        let ptr = self.get(self.get(typedef)?.size_or_type)?;
        let proto = *self.get(ptr.size_or_type)?;
        if ptr.kind != KIND_PTR || proto.kind != KIND_FUNC_PROTO {
            return Err(BtfError::Unexpected(format!(
                "btf_trace_{tracepoint} is not a function pointer"
            )));
        }
        (1..proto.vlen as usize)
            .map(|i| {
                let ty = u32_at(&self.types_data, proto.extra + 8 * i + 4)?;
                let t = self.get(self.strip(ty)?)?;
                if t.kind != KIND_PTR {
                    return Ok(String::new());
                }
                let target = self.get(self.strip(t.size_or_type)?)?;
                Ok(if target.kind == KIND_STRUCT {
                    self.name(target).to_string()
                } else {
                    String::new()
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probes::btf::builder::kernel_like;

    #[test]
    fn a_moved_member_moves_its_offset() {
        let btf = Btf::parse(&kernel_like(4)).expect("parse");
        assert_eq!(
            btf.member("iov_iter", "iov_offset").expect("member"),
            (4, 8)
        );
    }

    #[test]
    fn prototype_args_name_their_structs() {
        let btf = Btf::parse(&kernel_like(8)).expect("parse");
        assert_eq!(
            btf.tracepoint_args("tcp_sendmsg_locked").expect("args"),
            vec!["sock".to_string(), "msghdr".into(), String::new()]
        );
        assert!(matches!(
            btf.tracepoint_args("tcp_probe"),
            Err(BtfError::Missing(_))
        ));
    }

    #[test]
    fn rejects_what_is_not_btf() {
        assert!(Btf::parse(b"not btf at all, not btf at all").is_err());
        let mut blob = kernel_like(8);
        blob.truncate(blob.len() - 40);
        assert!(Btf::parse(&blob).is_err());
    }
}
