//! `check --pid PID`: what the tracer would find in one process, read as
//! the tracer reads it (its mappings through the library finder): the CUDA
//! libraries it would probe, and the TLS libraries it maps, each named with
//! what is read of its connections.

use std::path::PathBuf;

use super::Item;
use crate::probes::libraries::{LibraryError, Scan, Scanner, TlsLibrary};

/// The items for process `pid`.
pub fn items(pid: u32) -> Vec<Item> {
    let comm = crate::host::targets::comm(pid).unwrap_or_default();
    match Scanner::default().scan(pid) {
        Ok(scan) => judge(pid, &comm, &scan),
        Err(e @ LibraryError::NoProcess(_)) => vec![Item::fail(
            "target",
            e.to_string(),
            "give the pid of a running server process",
        )],
        Err(e) => vec![Item::fail(
            "target",
            format!("pid {pid}: its mappings could not be read: {e}"),
            "run check as root (the tracer reads /proc/PID/maps and map_files)",
        )],
    }
}

/// The verdicts on what a scan of `pid` found.
fn judge(pid: u32, comm: &str, scan: &Scan) -> Vec<Item> {
    let name = format!("pid {pid} ({comm})");
    let libs: Vec<String> = scan
        .libraries
        .iter()
        .map(|l| {
            let apis: Vec<&str> = l.apis.iter().map(|f| f.name()).collect();
            format!("{} ({})", l.path.display(), apis.join(", "))
        })
        .collect();
    let cuda = if libs.is_empty() {
        Item::warn(
            "target CUDA",
            format!(
                "{name} maps no CUDA library ({} files searched): its requests are followed \
                 only if a process of its tree makes the CUDA calls",
                scan.searched.len()
            ),
            "trace the process whose tree makes the CUDA calls, or name the runtime with \
             --cuda-lib",
        )
    } else {
        Item::ok("target CUDA", format!("{name} maps {}", libs.join("; ")))
    };
    vec![cuda, tls_item(&name, &scan.tls)]
}

/// The TLS libraries a process maps: none is read yet, so each is a
/// warning that says what its connections will show.
fn tls_item(name: &str, tls: &[(PathBuf, TlsLibrary)]) -> Item {
    if tls.is_empty() {
        return Item::ok(
            "target TLS",
            format!("{name} maps no TLS library: its connections are read in clear text"),
        );
    }
    let found: Vec<String> = tls
        .iter()
        .map(|(path, lib)| format!("TLS via {} ({}): not traced", lib.name(), path.display()))
        .collect();
    Item::warn(
        "target TLS",
        format!(
            "{name}: {}; a TLS connection's requests are reported tls_unsupported, its \
             handshake timed from the wire",
            found.join("; ")
        ),
        "terminate TLS in front of the server (a proxy outside the traced tree), or trace \
         the plaintext hop behind it",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::Verdict;

    #[test]
    fn tls_libraries_are_named_with_what_is_read() {
        let none = tls_item("pid 1 (srv)", &[]);
        assert_eq!(none.verdict, Verdict::Ok);
        let item = tls_item(
            "pid 1 (srv)",
            &[
                ("/usr/lib/libssl.so.3".into(), TlsLibrary::OpenSsl),
                ("/usr/lib/libgnutls.so.30".into(), TlsLibrary::GnuTls),
            ],
        );
        assert_eq!(item.verdict, Verdict::Warn);
        assert!(
            item.detail
                .contains("TLS via OpenSSL (/usr/lib/libssl.so.3): not traced"),
            "{}",
            item.detail
        );
        assert!(item.detail.contains("TLS via GnuTLS"), "{}", item.detail);
    }

    #[test]
    fn this_test_process_is_judged() {
        let items = items(std::process::id());
        assert_eq!(items.len(), 2, "{items:?}");
        assert_eq!(items[0].name, "target CUDA");
        assert_eq!(items[0].verdict, Verdict::Warn, "no CUDA here: {items:?}");
        let gone = super::items(u32::MAX - 1);
        assert_eq!(gone[0].verdict, Verdict::Fail, "{gone:?}");
    }
}
