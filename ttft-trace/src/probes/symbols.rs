//! Uprobe targets as data: the families of libraries probed (the CUDA
//! runtime, the CUDA driver; OpenSSL), each declared by a table ([`Family`]) of the
//! functions probed, the eBPF program of each, its role, whether its
//! return is probed too, and so the order its probes are attached in. The
//! finder ([`super::libraries`]) and the attacher read these tables and
//! nothing else of a family: a family is added by writing its table (and
//! its programs) and naming it in [`FAMILIES`].

pub use super::family::{Family, ProbedSymbol, Role};
use super::{cuda, openssl};

/// Every family that makes a workload (a process calling one is a GPU
/// workload), in the order files' families are listed in (the JSONL
/// `library` records, the log).
pub static FAMILIES: &[&Family] = &[&cuda::RUNTIME, &cuda::DRIVER];

/// The TLS libraries read: probed only in processes traced already, for
/// each process (never host-wide), and never a reason to trace one.
pub static TLS_FAMILIES: &[&Family] = &[&openssl::OPENSSL, &openssl::OPENSSL_BIO];

/// Every family of both lists.
fn all() -> impl Iterator<Item = &'static Family> {
    FAMILIES.iter().chain(TLS_FAMILIES).copied()
}

/// Looks a symbol name up in every family, ignoring an ELF version suffix
/// (`cudaLaunchKernel@@libcudart.so.12` as some symbol tables spell it).
pub fn lookup(name: &str) -> Option<(&'static Family, &'static ProbedSymbol)> {
    let base = name.split('@').next().unwrap_or(name);
    all().find_map(|f| Some((f, f.symbols.iter().find(|s| s.name == base)?)))
}

/// Whether `name` is a marker of a family that makes a workload
/// ([`FAMILIES`], [`Family::markers`]).
pub fn is_marker(name: &str) -> bool {
    FAMILIES.iter().any(|f| f.markers.contains(&name))
}

/// Every distinct eBPF program name the tables use, returns included.
pub fn program_names() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = all()
        .flat_map(|f| f.symbols)
        .flat_map(|s| [Some(s.program), s.returns])
        .flatten()
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_strips_versions() {
        let (family, s) = lookup("cudaLaunchKernel@@libcudart.so.12").expect("found");
        assert_eq!(s.program, "cuda_launch_kernel");
        assert_eq!(family, &cuda::RUNTIME);
        assert_eq!(
            lookup("cuLaunchKernel").map(|(f, _)| f),
            Some(&cuda::DRIVER)
        );
        assert!(lookup("cudaMalloc").is_none());
    }

    #[test]
    fn no_symbol_is_listed_twice() {
        let mut names: Vec<_> = all().flat_map(|f| f.symbols).map(|s| s.name).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(n, names.len(), "duplicate symbol");
        let mut families: Vec<_> = all().map(|f| f.name).collect();
        families.sort_unstable();
        families.dedup();
        assert_eq!(families.len(), all().count(), "duplicate family");
    }

    #[test]
    fn markers_are_probed_launches_of_their_family() {
        for family in all() {
            assert!(!family.markers.is_empty(), "{family:?} has no marker");
            for m in family.markers {
                let s = family.symbols.iter().find(|s| s.name == *m);
                assert!(s.is_some_and(|s| s.is_launch()), "{m} of {family:?}");
            }
        }
    }

    #[test]
    fn a_program_serves_one_role_and_never_both_entry_and_return() {
        let all: Vec<_> = all().flat_map(|f| f.symbols).collect();
        for s in &all {
            assert!(
                all.iter()
                    .filter(|o| o.program == s.program)
                    .all(|o| o.role == s.role && o.returns == s.returns),
                "{s:?}"
            );
            assert!(all.iter().all(|o| o.returns != Some(s.program)), "{s:?}");
        }
    }

    /// Every program the tables name is in the eBPF object (built by
    /// build.rs; empty with AYA_BUILD_SKIP, where there is nothing to
    /// check), as a function of a uprobe section: read from the ELF file,
    /// no kernel needed.
    #[test]
    fn every_program_is_in_the_ebpf_object() {
        use object::{Object, ObjectSection, ObjectSymbol, SymbolKind};
        if super::super::OBJECT.is_empty() {
            return;
        }
        let elf = object::File::parse(super::super::OBJECT).expect("the eBPF object");
        let in_uprobe_section = |s: &object::Symbol<'_, '_>| {
            s.section_index()
                .and_then(|i| elf.section_by_index(i).ok())
                .and_then(|sec| sec.name().ok())
                .is_some_and(|n| n.starts_with("uprobe") || n.starts_with("uretprobe"))
        };
        let programs: Vec<&str> = elf
            .symbols()
            .filter(|s| s.kind() == SymbolKind::Text && in_uprobe_section(s))
            .filter_map(|s| s.name().ok())
            .collect();
        for name in program_names() {
            assert!(programs.contains(&name), "{name} not in {programs:?}");
        }
    }
}
