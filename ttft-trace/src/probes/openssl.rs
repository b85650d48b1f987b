//! The OpenSSL family: the calls that tell which TLS call a traced thread
//! is in (the eBPF side's `tls.rs` says how a send inside `SSL_write` is
//! bound to its connection). Unlike the CUDA families, it never makes a
//! workload and is never probed host-wide: a file carrying OpenSSL is
//! probed for each traced process that maps it, so that the host's other
//! processes calling `SSL_write` take no trap ([`super::symbols::TLS_FAMILIES`]).
//! Its second table, [`OPENSSL_BIO`], is `libcrypto`'s record writes, which
//! bind a memory BIO's records to the send that carries them.

use super::family::{Family, ProbedSymbol, Role};

/// OpenSSL 1.1 and 3 (`libssl`, a copy vendored in a wheel, or a server
/// binary exporting its statically linked one).
pub static OPENSSL: Family = Family {
    name: "openssl",
    markers: &["SSL_write"],
    symbols: &[
        call("SSL_write", "ssl_write", Role::Opens),
        call("SSL_write_ex", "ssl_write_ex", Role::Opens),
        call("SSL_read", "ssl_read", Role::Opens),
        call("SSL_read_ex", "ssl_read_ex", Role::Opens),
        call("SSL_do_handshake", "ssl_control", Role::Completes),
        call("SSL_accept", "ssl_control", Role::Completes),
        call("SSL_shutdown", "ssl_control", Role::Completes),
    ],
};

/// OpenSSL's `libcrypto` (or the same file as `libssl` where linked
/// statically): the writes of records to a BIO, which inside a TLS call of
/// a memory BIO's `SSL` hold each record for the TCP send that carries it
/// later (the eBPF side's `tls_records.rs`). Entry only; a record held
/// opens its wait for a send.
pub static OPENSSL_BIO: Family = Family {
    name: "openssl-bio",
    markers: &["BIO_write"],
    symbols: &[
        ProbedSymbol {
            name: "BIO_write",
            program: "bio_write",
            returns: None,
            role: Role::Opens,
        },
        ProbedSymbol {
            name: "BIO_write_ex",
            program: "bio_write_ex",
            returns: None,
            role: Role::Opens,
        },
    ],
};

/// The return program every call shares: it ends the thread's call.
const RETURN: &str = "ssl_return";

/// A TLS call, entry and return probed (the return first, as the attacher
/// does: an entry without its return would leave the thread inside a call
/// for good). The data calls are attached after the handshake's, so that a
/// connection's records are never read as data before its handshake's are
/// known as TLS's own.
const fn call(name: &'static str, program: &'static str, role: Role) -> ProbedSymbol {
    ProbedSymbol {
        name,
        program,
        returns: Some(RETURN),
        role,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_call_has_its_return_probed() {
        assert!(OPENSSL.symbols.iter().all(|s| s.returns == Some(RETURN)));
        assert!(OPENSSL.markers.iter().all(|m| {
            OPENSSL
                .symbols
                .iter()
                .any(|s| s.name == *m && s.is_launch())
        }));
    }
}
