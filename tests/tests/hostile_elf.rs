//! The ELF inspection of the stub CUDA libraries built for the tests, no
//! root needed: the family each is found as, the order their probes are
//! attached in, and regression
//! tests for what the fuzzers found (a mapped file's headers are its
//! owner's, and a CUDA library whose program headers wrap the address
//! space must be refused or read, never panic; the stub is patched on disk).
//! One root test: the daemon refuses a mapped file over a cap and counts it.

use std::time::Duration;

use anyhow::{Context as _, Result};
use ttft_trace::probes::libraries;
use ttft_trace_tests::{
    fixtures::{existing_fixture, map_file, temp_path},
    otlp_receiver::free_addr,
    tracer::{Tracer, http_get, metric_total, root_test, workload_daemon_args},
};

fn u16_at(b: &[u8], at: usize) -> usize {
    usize::from(u16::from_le_bytes([b[at], b[at + 1]]))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// The stub runtime with every loadable segment after the first made to
/// end past the top of the address space (p_filesz = u64::MAX).
fn wrapping_segments() -> Result<Vec<u8>> {
    let mut elf = std::fs::read(existing_fixture("libcudart.so.12")?)?;
    assert_eq!(&elf[..4], b"\x7fELF", "an ELF file");
    let phoff = usize::try_from(u64_at(&elf, 0x20))?;
    let (phentsize, phnum) = (u16_at(&elf, 0x36), u16_at(&elf, 0x38));
    let mut loads = 0;
    for i in 0..phnum {
        let ph = phoff + i * phentsize;
        let p_type = u32::from_le_bytes(elf[ph..ph + 4].try_into()?);
        if p_type != 1 {
            continue;
        }
        loads += 1;
        if loads > 1 && u64_at(&elf, ph + 16) > 0 {
            elf[ph + 32..ph + 40].copy_from_slice(&u64::MAX.to_le_bytes());
        }
    }
    assert!(loads > 1, "the stub runtime has several loadable segments");
    Ok(elf)
}

/// What the finder makes of a patched copy of a stub, written to a
/// temporary file (removed after).
fn inspect_patched(
    name: &str,
    elf: Vec<u8>,
) -> Result<Result<Option<libraries::Library>, libraries::LibraryError>> {
    let path = temp_path(name, "so");
    std::fs::write(&path, elf).context("writing the patched copy")?;
    let found = libraries::inspect(&path, &path);
    let _ = std::fs::remove_file(&path);
    Ok(found)
}

#[test]
fn program_headers_that_wrap_the_address_space_do_not_panic() -> Result<()> {
    let found = inspect_patched("wrapping-elf", wrapping_segments()?)?;
    // Either refused or found with no probe offset out of the file: no panic
    // and no offset computed from a wrapped sum.
    if let Ok(Some(lib)) = found {
        let len = std::fs::metadata(existing_fixture("libcudart.so.12")?)?.len();
        for (symbol, offset) in &lib.symbols {
            assert!(
                *offset < len,
                "{symbol:?} at {offset}, past the file ({len} bytes)"
            );
        }
    }
    Ok(())
}

/// Copies and syncs are probed before launches: an attach while the
/// process runs then never sees an episode's launches without the call
/// that completes it (which would join them to the next episode's).
#[test]
fn launch_probes_are_attached_last() -> Result<()> {
    for name in ["libcudart.so.12", "libcuda.so.1"] {
        let path = existing_fixture(name)?;
        let lib = libraries::inspect(&path, &path)?.context("a CUDA library")?;
        let order: Vec<bool> = lib.symbols.iter().map(|(s, _)| s.is_launch()).collect();
        let first_launch = order.iter().position(|l| *l).context("a launch symbol")?;
        assert!(first_launch > 0, "{name}: no copy or sync symbol");
        assert!(
            order[first_launch..].iter().all(|l| *l),
            "{name}: {:?}",
            lib.symbols
        );
    }
    Ok(())
}

/// The generic finder reads the family tables: each stub is found as its
/// own family, at symbols of that family's table only, every marker of it
/// among them.
#[test]
fn the_stubs_are_found_as_their_family() -> Result<()> {
    for (name, family) in [
        ("libcudart.so.12", &ttft_trace::probes::cuda::RUNTIME),
        ("libcuda.so.1", &ttft_trace::probes::cuda::DRIVER),
    ] {
        let path = existing_fixture(name)?;
        let lib = libraries::inspect(&path, &path)?.context("a CUDA library")?;
        assert_eq!(lib.apis, [family], "{name}");
        for (symbol, _) in &lib.symbols {
            assert!(family.symbols.contains(symbol), "{name}: {symbol:?}");
        }
        for marker in family.markers {
            assert!(
                lib.symbols.iter().any(|(s, _)| s.name == *marker),
                "{name}: {marker}"
            );
        }
    }
    Ok(())
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// The stub runtime with every defined function of each symbol table
/// renamed `cudaLaunchKernel`: one name at some forty addresses, as a
/// hostile file with tens of thousands of copies has, in small.
fn one_name_at_every_function() -> Result<Vec<u8>> {
    let mut elf = std::fs::read(existing_fixture("libcudart.so.12")?)?;
    let shoff = usize::try_from(u64_at(&elf, 0x28))?;
    let (shentsize, shnum) = (u16_at(&elf, 0x3a), u16_at(&elf, 0x3c));
    let section = |i: usize| shoff + i * shentsize;
    let mut renamed = 0;
    for i in 0..shnum {
        let sh = section(i);
        // SHT_SYMTAB (2) and SHT_DYNSYM (11), with their string table.
        if !matches!(u32_at(&elf, sh + 4), 2 | 11) {
            continue;
        }
        let strtab = section(usize::try_from(u32_at(&elf, sh + 40))?);
        let (str_off, str_len) = (u64_at(&elf, strtab + 24), u64_at(&elf, strtab + 32));
        let strings = &elf[usize::try_from(str_off)?..usize::try_from(str_off + str_len)?];
        let name = strings
            .windows(17)
            .position(|w| w == b"cudaLaunchKernel\0")
            .context("cudaLaunchKernel in the string table")?;
        let (off, size) = (u64_at(&elf, sh + 24), u64_at(&elf, sh + 32));
        for sym in (usize::try_from(off)?..usize::try_from(off + size)?).step_by(24) {
            let is_func = elf[sym + 4] & 0xf == 2;
            if is_func && u16_at(&elf, sym + 6) != 0 {
                elf[sym..sym + 4].copy_from_slice(&u32::try_from(name)?.to_le_bytes());
                renamed += 1;
            }
        }
    }
    assert!(renamed > 20, "{renamed} functions renamed");
    Ok(elf)
}

/// One name at more addresses than the cap refuses the file, with the
/// reason, rather than attach a uprobe at each (issue 28: tens of
/// thousands of copies made ten thousand uprobes and froze the host's
/// uprobe registration).
#[test]
fn a_name_defined_at_many_addresses_refuses_the_library() -> Result<()> {
    let found = inspect_patched("many-copies-elf", one_name_at_every_function()?)?;
    match found {
        Err(e @ libraries::LibraryError::TooManyCopies { .. }) => {
            assert!(e.to_string().contains("cudaLaunchKernel"), "{e}");
        }
        other => panic!("expected TooManyCopies, got {other:?}"),
    }
    Ok(())
}

/// The daemon meets such a file mapped by a process: not probed, a warning
/// naming it, counted once in `ttft_trace_libraries_refused_total`
/// (issue 28 item 2), however often the process is scanned.
#[test]
fn the_daemon_refuses_a_mapped_library_over_a_cap_and_counts_it() -> Result<()> {
    let Some(_g) = root_test("the_daemon_refuses_a_mapped_library_over_a_cap_and_counts_it") else {
        return Ok(());
    };
    let path = temp_path("many-copies-mapped", "so");
    std::fs::write(&path, one_name_at_every_function()?)?;
    // A process named `workload` (the tests' comm filter) that maps it.
    let _mapper = map_file(&path)?;
    let addr = free_addr()?;
    let mut tracer = Tracer::start_daemon(&workload_daemon_args(addr))?;
    tracer.wait_for_stderr("defined at over 16 addresses", 1, Duration::from_secs(20))?;
    // Scanned again and again (every 200 ms): counted once.
    std::thread::sleep(Duration::from_millis(1000));
    let metrics = http_get(addr, "/metrics")?;
    let out = tracer.interrupt(Duration::from_secs(30))?;
    let _ = std::fs::remove_file(&path);
    assert!(out.success, "{}", out.stderr);
    let refused = |reason: &str| {
        metric_total(
            &metrics,
            &format!("ttft_trace_libraries_refused_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(refused("too_many_copies"), 1, "{metrics}");
    assert_eq!(refused("too_large"), 0);
    assert_eq!(
        out.stderr.matches("defined at over 16 addresses").count(),
        1,
        "warned once: {}",
        out.stderr
    );
    assert!(!out.stderr.contains("attached"), "{}", out.stderr);
    Ok(())
}

/// Each probed name is probed at one address: the stubs, which define each
/// once in both tables, get one probe per name.
#[test]
fn each_name_is_probed_once() -> Result<()> {
    for name in ["libcudart.so.12", "libcuda.so.1"] {
        let path = existing_fixture(name)?;
        let lib = libraries::inspect(&path, &path)?.context("a CUDA library")?;
        let mut names: Vec<&str> = lib.symbols.iter().map(|(s, _)| s.name).collect();
        let probes = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), probes, "{name}: {:?}", lib.symbols);
    }
    Ok(())
}
