//! A mapped file of a traced process is any bytes its owner wrote: the ELF
//! inspection that looks for the CUDA entry points must refuse what it
//! cannot read, never panic or read out of bounds.

#![no_main]

use std::io::Write as _;

use libfuzzer_sys::fuzz_target;
use ttft_trace::probes::libraries;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("ttft-fuzz-elf-{}", std::process::id()));
    let written = std::fs::File::create(&path).and_then(|mut f| f.write_all(data));
    if written.is_ok() {
        let _ = libraries::inspect(&path, &path);
    }
});
