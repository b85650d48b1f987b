//! `check --pid PID`: what the tracer would find in one process, read as
//! the tracer reads it (its mappings through the library finder): the CUDA
//! libraries it would probe, and the TLS libraries it maps, each named with
//! what is read of its connections.

use super::Item;
use crate::probes::libraries::{LibraryError, Scan, Scanner};

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
    vec![cuda, tls_item(&name, scan)]
}

/// The TLS libraries a process maps, each with what is read of it. Mapping
/// one is not serving TLS (every Python server maps OpenSSL through its
/// `ssl` module): said as what would happen if it did. Files it could not
/// open are a warning: a library among them would go unseen.
fn tls_item(name: &str, scan: &Scan) -> Item {
    let found: Vec<String> = scan
        .tls_read()
        .map(|(path, lib, probed)| {
            format!(
                "TLS via {} ({}): {}",
                lib.name(),
                path.display(),
                lib.reading(probed)
            )
        })
        .collect();
    if !scan.denied.is_empty() {
        return Item::warn(
            "target TLS",
            format!(
                "{name}: {} of its mapped files could not be opened, so a TLS library among them \
                 would go unseen{}",
                scan.denied.len(),
                if found.is_empty() {
                    String::new()
                } else {
                    format!("; {}", found.join("; "))
                }
            ),
            "run check as root (the mapped files are opened through /proc/PID/map_files)",
        );
    }
    if found.is_empty() {
        return Item::ok(
            "target TLS",
            format!(
                "{name}: no TLS library found in its {} mapped files (one linked in and \
                 stripped would not show): its connections are read in clear text",
                scan.searched.len()
            ),
        );
    }
    Item::ok(
        "target TLS",
        format!(
            "{name}: {} (mapping a TLS library is not serving TLS)",
            found.join("; ")
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{check::Verdict, probes::libraries::TlsLibrary};

    #[test]
    fn tls_libraries_are_named_with_what_is_read() {
        let none = tls_item("pid 1 (srv)", &Scan::default());
        assert_eq!(none.verdict, Verdict::Ok);
        assert!(
            none.detail.contains("no TLS library found"),
            "{}",
            none.detail
        );
        let scan = Scan {
            tls: vec![
                ("/usr/lib/libssl.so.3".into(), TlsLibrary::OpenSsl),
                ("/usr/lib/libgnutls.so.30".into(), TlsLibrary::GnuTls),
            ],
            ..Scan::default()
        };
        let item = tls_item("pid 1 (srv)", &scan);
        assert_eq!(item.verdict, Verdict::Ok);
        assert!(
            item.detail.contains("is not serving TLS"),
            "{}",
            item.detail
        );
        assert!(
            item.detail
                .contains("TLS via OpenSSL (/usr/lib/libssl.so.3): not traced"),
            "{}",
            item.detail
        );
        assert!(item.detail.contains("TLS via GnuTLS"), "{}", item.detail);
        // Files it could not open: nothing can be said of them.
        let denied = Scan {
            denied: vec!["/opt/srv/libssl.so".into()],
            ..Scan::default()
        };
        assert_eq!(tls_item("pid 1 (srv)", &denied).verdict, Verdict::Warn);
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
