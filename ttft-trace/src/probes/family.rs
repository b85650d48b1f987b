//! The table a family of libraries is declared by (see [`super::symbols`]
//! for the families probed): per function, the eBPF program of its entry,
//! that of its return where the return is probed too, and its role, which
//! orders the attach.

/// One family of libraries: what makes a file one to probe, and what is
/// probed in it.
#[derive(PartialEq, Eq)]
pub struct Family {
    /// The family's name in logs, JSONL and metric labels.
    pub name: &'static str,
    /// A file is probed when it defines one of these (of any family): a
    /// library that merely wraps a probed call (a copy, a sync) is not one
    /// of the family. It is then probed at every symbol it defines, of
    /// every family.
    pub markers: &'static [&'static str],
    /// The probed functions.
    pub symbols: &'static [ProbedSymbol],
}

impl Family {
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Whether `sym` is one of this family's probed functions (the same
    /// entry of its table, not one of another family of the same name).
    pub fn owns(&self, sym: &ProbedSymbol) -> bool {
        self.symbols.iter().any(|s| std::ptr::eq(s, sym))
    }
}

/// A family stands for its name in debug output (its table is long).
impl std::fmt::Debug for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

/// What a probed call does, as far as attaching goes: a file's probes are
/// attached role by role, in this order (then by symbol name and offset).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// Completes or waits for work (a copy, a synchronisation).
    Completes,
    /// Opens a unit of work (a CUDA kernel or graph launch opens an
    /// episode). Attached last: once such a call is seen, the calls that
    /// complete its work are probed too, so an attach in the middle of a
    /// running process never joins one unit's opening to the next one's
    /// completion.
    Opens,
}

/// One probed function.
#[derive(Debug, PartialEq, Eq)]
pub struct ProbedSymbol {
    /// Exported name; variants (CUDA's `_ptsz`/`_ptds` per-thread default
    /// stream ones) are listed separately, with the same program.
    pub name: &'static str,
    /// eBPF program for the entry.
    pub program: &'static str,
    /// eBPF program for the return, where the return is probed too (both
    /// or neither, the return first: see the attacher), or None: entry only.
    pub returns: Option<&'static str>,
    pub role: Role,
}

impl ProbedSymbol {
    /// Whether the call opens a unit of work ([`Role::Opens`]).
    pub fn is_launch(&self) -> bool {
        self.role == Role::Opens
    }
}
