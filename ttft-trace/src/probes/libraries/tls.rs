//! Which TLS library an ELF file carries, told by the symbols it defines, so
//! that the attach log and `check --pid` can say how a server's TLS is
//! terminated, and what of it is read. The symbol walk is the CUDA finder's
//! own (`elf.rs`): each name is looked at once, by exact names and cheap
//! prefixes, never by a search through the name, except Rust's v0-mangled
//! names, where the crate's name sits after a hash.
//!
//! OpenSSL's plaintext is read where it sends its own records (a socket
//! BIO; `probes/openssl.rs`, the eBPF side's `tls.rs`); a connection
//! another library terminates is `tls_unsupported`, its handshake timed from
//! the wire (`requests/tls.rs`).

/// A TLS implementation a mapped file carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TlsLibrary {
    /// `SSL_write` exported, with OpenSSL's initialiser: the system
    /// `libssl`, a copy vendored by a wheel, or a server binary that exports
    /// its statically linked OpenSSL (Node).
    OpenSsl,
    /// `SSL_write` exported, with BoringSSL's own API beside it.
    BoringSsl,
    /// `SSL_write` exported without OpenSSL's own API: another library's
    /// compatibility layer (GnuTLS's `libgnutls-openssl`).
    SslCompat,
    /// `SSL_write` defined but not exported (BoringSSL or OpenSSL linked
    /// with hidden visibility, as gRPC's core is): found only in a symbol
    /// table a stripped file lacks.
    HiddenSsl,
    GnuTls,
    /// Mozilla's NSS.
    Nss,
    /// Rust's rustls, linked statically (seen in an unstripped binary).
    Rustls,
    /// Go's `crypto/tls`, in a Go binary with its symbol table.
    GoCryptoTls,
}

impl TlsLibrary {
    /// What is read of the connections the library terminates, `probed`
    /// where its plaintext probes were found (the attach log, `check`).
    pub fn reading(self, probed: bool) -> &'static str {
        if probed {
            "plaintext read where OpenSSL sends its own records (a socket BIO), and where \
             the process sends them itself (a memory BIO, as asyncio does) when OpenSSL's \
             libcrypto is mapped too, bound by their ciphertext; calls whose records were \
             never seen sent are counted (ttft_trace_tls_plaintext_unbound_total, \
             ttft_trace_tls_plaintext_held_total less ..._sent_total)"
        } else {
            "not traced (if it serves TLS itself, those connections are reported \
             tls_unsupported, their handshakes timed from the wire)"
        }
    }

    /// As the log, `check` and the JSONL `library` lines name it.
    pub fn name(self) -> &'static str {
        match self {
            Self::OpenSsl => "OpenSSL",
            Self::BoringSsl => "BoringSSL",
            Self::SslCompat => "an OpenSSL-compatible layer (not OpenSSL)",
            Self::HiddenSsl => "OpenSSL or BoringSSL with hidden symbols",
            Self::GnuTls => "GnuTLS",
            Self::Nss => "NSS",
            Self::Rustls => "rustls",
            Self::GoCryptoTls => "Go crypto/tls",
        }
    }
}

/// What of a TLS library the symbols seen so far show.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct TlsMarks {
    ssl_write: bool,
    ssl_write_hidden: bool,
    /// OpenSSL's own API (1.1 and 3: its initialiser; 1.0 and later: the
    /// control call its macros expand to), which compatibility layers lack.
    openssl_api: bool,
    /// OpenSSL's `libcrypto`: `BIO_write` and its initialiser, exported.
    bio_write: bool,
    crypto_api: bool,
    boringssl_api: bool,
    gnutls: bool,
    nss: bool,
    rustls: bool,
    go: bool,
}

/// Whether a v0-mangled name has `ident` (its decimal length, then its
/// characters) as an identifier of its own: the length is all of the
/// digits, not the tail of a longer one's (`16rustls_pki_types`).
fn v0_crate(name: &str, ident: &str) -> bool {
    name.match_indices(ident)
        .any(|(i, _)| i > 0 && !name.as_bytes()[i - 1].is_ascii_digit())
}

impl TlsMarks {
    /// One defined function of the file; `exported`: visible to other
    /// objects (not hidden, not local).
    pub fn see(&mut self, name: &str, exported: bool) {
        let base = name.split('@').next().unwrap_or(name);
        match base {
            "SSL_write" if exported => self.ssl_write = true,
            "SSL_write" => self.ssl_write_hidden = true,
            "OPENSSL_init_ssl" | "SSL_CTX_ctrl" => self.openssl_api = true,
            "BIO_write" if exported => self.bio_write = true,
            "OPENSSL_init_crypto" if exported => self.crypto_api = true,
            // BoringSSL's own API, which OpenSSL does not have.
            "SSL_CTX_set_grease_enabled" | "CRYPTO_BUFFER_new" => self.boringssl_api = true,
            "gnutls_record_send" => self.gnutls = true,
            "SSL_ImportFD" => self.nss = true,
            _ if base.starts_with("crypto/tls.") => self.go = true,
            // Legacy mangling begins with the crate's name; v0 mangling has
            // it after the crate's hash.
            _ if base.starts_with("_ZN6rustls") => self.rustls = true,
            _ if base.starts_with("_R") && v0_crate(base, "6rustls") => self.rustls = true,
            _ => {}
        }
    }

    /// Whether the file is OpenSSL's `libcrypto` (on its own, or linked in
    /// with `libssl`): its record writes are probed
    /// ([`crate::probes::openssl::OPENSSL_BIO`]).
    pub fn openssl_crypto(&self) -> bool {
        self.bio_write && self.crypto_api && !self.boringssl_api
    }

    /// The library the file carries, the exported OpenSSL API first (its
    /// symbols are what a future uprobe attaches to).
    pub fn library(&self) -> Option<TlsLibrary> {
        if self.ssl_write {
            return Some(match (self.boringssl_api, self.openssl_api) {
                (true, _) => TlsLibrary::BoringSsl,
                (false, true) => TlsLibrary::OpenSsl,
                (false, false) => TlsLibrary::SslCompat,
            });
        }
        [
            (self.gnutls, TlsLibrary::GnuTls),
            (self.nss, TlsLibrary::Nss),
            (self.rustls, TlsLibrary::Rustls),
            (self.go, TlsLibrary::GoCryptoTls),
            (self.ssl_write_hidden, TlsLibrary::HiddenSsl),
        ]
        .into_iter()
        .find_map(|(seen, lib)| seen.then_some(lib))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(names: &[(&str, bool)]) -> Option<TlsLibrary> {
        let mut m = TlsMarks::default();
        for (n, exported) in names {
            m.see(n, *exported);
        }
        m.library()
    }

    #[test]
    fn each_library_by_its_symbols() {
        let openssl = [
            ("SSL_write@@OPENSSL_3.0.0", true),
            ("OPENSSL_init_ssl@@OPENSSL_3.0.0", true),
        ];
        assert_eq!(of(&openssl), Some(TlsLibrary::OpenSsl));
        let boring = [("SSL_write", true), ("SSL_CTX_set_grease_enabled", true)];
        assert_eq!(of(&boring), Some(TlsLibrary::BoringSsl));
        let compat = [("SSL_write", true), ("SSL_library_init", true)];
        assert_eq!(of(&compat), Some(TlsLibrary::SslCompat));
        assert_eq!(of(&[("SSL_write", false)]), Some(TlsLibrary::HiddenSsl));
        assert_eq!(
            of(&[("gnutls_record_send@@GNUTLS_3_4", true)]),
            Some(TlsLibrary::GnuTls)
        );
        assert_eq!(of(&[("SSL_ImportFD", true)]), Some(TlsLibrary::Nss));
        assert_eq!(
            of(&[(
                "_ZN6rustls4conn10Connection5write17h0123456789abcdefE",
                false
            )]),
            Some(TlsLibrary::Rustls)
        );
        assert_eq!(
            of(&[(
                "_RNvMs_NtCs4fqI2P2rA04_6rustls4connNtB4_10Connection5write",
                false
            )]),
            Some(TlsLibrary::Rustls)
        );
        assert_eq!(
            of(&[("crypto/tls.(*Conn).Write", false)]),
            Some(TlsLibrary::GoCryptoTls)
        );
    }

    /// OpenSSL's `libcrypto` (its record writes probed) is no TLS library
    /// of its own; BoringSSL's is neither.
    #[test]
    fn openssls_libcrypto_by_its_symbols() {
        let marks = |names: &[(&str, bool)]| {
            let mut m = TlsMarks::default();
            for (n, exported) in names {
                m.see(n, *exported);
            }
            m
        };
        let crypto = marks(&[
            ("BIO_write@@OPENSSL_3.0.0", true),
            ("OPENSSL_init_crypto@@OPENSSL_3.0.0", true),
        ]);
        assert!(crypto.openssl_crypto());
        assert_eq!(crypto.library(), None);
        let boring = marks(&[
            ("BIO_write", true),
            ("OPENSSL_init_crypto", true),
            ("CRYPTO_BUFFER_new", true),
        ]);
        assert!(!boring.openssl_crypto());
        let hidden = marks(&[("BIO_write", false), ("OPENSSL_init_crypto", true)]);
        assert!(!hidden.openssl_crypto());
    }

    #[test]
    fn look_alikes_are_no_tls_library() {
        assert_eq!(
            of(&[
                ("SSL_writer", true),
                ("my_SSL_write", true),
                ("_ZN9notrustls3foo", false),
                ("_RNvCs1a2b_16rustls_pki_types3foo", false),
                ("gnutls_record_send_file", true),
                ("crypto/tlsx.Foo", false),
                ("cudaLaunchKernel", true),
            ]),
            None
        );
        // A wrapper that calls SSL_write defines its own names, not it.
        assert_eq!(of(&[("OPENSSL_init_ssl", true)]), None);
    }
}

#[cfg(test)]
mod real_files {
    use std::path::Path;

    use super::*;

    /// The TLS libraries of this machine's own files, where it has them
    /// (Debian 12's OpenSSL 3.0, GnuTLS 3.7 with its OpenSSL layer, NSS).
    #[test]
    fn system_tls_libraries_are_named() {
        let lib = "/usr/lib/x86_64-linux-gnu";
        let cases = [
            ("libssl.so.3", Some(TlsLibrary::OpenSsl)),
            ("libgnutls.so.30", Some(TlsLibrary::GnuTls)),
            ("libgnutls-openssl.so.27", Some(TlsLibrary::SslCompat)),
            ("libssl3.so", Some(TlsLibrary::Nss)),
            ("libcrypto.so.3", None),
            // A Go binary with its symbol table (Docker's CLI, where set up).
            ("/usr/local/bin/docker", Some(TlsLibrary::GoCryptoTls)),
        ];
        let mut seen = 0;
        for (file, want) in cases {
            let path = Path::new(lib).join(file);
            if !path.exists() {
                eprintln!("{} absent here: not checked", path.display());
                continue;
            }
            let got = crate::probes::libraries::tls_library(&path).expect("readable");
            assert_eq!(got, want, "{}", path.display());
            seen += 1;
        }
        eprintln!("{seen} system TLS files checked");
    }
}
