//! The ELF inspection of the stub CUDA libraries built for the tests, no
//! root needed: the family each is found as, the order their probes are
//! attached in, and regression
//! tests for what the fuzzers found (a mapped file's headers are its
//! owner's, and a CUDA library whose program headers wrap the address
//! space must be refused or read, never panic; the stub is patched on disk).

use anyhow::{Context as _, Result};
use ttft_trace::probes::libraries;
use ttft_trace_tests::fixtures::{existing_fixture, temp_path};

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

#[test]
fn program_headers_that_wrap_the_address_space_do_not_panic() -> Result<()> {
    let path = temp_path("wrapping-elf", "so");
    std::fs::write(&path, wrapping_segments()?).context("writing the patched copy")?;
    let found = libraries::inspect(&path, &path);
    let _ = std::fs::remove_file(&path);
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
