//! A TLS connection: its sends are records, never read as HTTP or as an
//! opaque response whose first send would be a first token.

use super::{Wire, ms};
use crate::requests::{Framing, Outcome};

const SK: u64 = 0x715;
const T0: u64 = ms(1000);

/// `n` records of `kind` (22 handshake, 23 application data), each of
/// `len` bytes of payload, in one send.
fn records(kind: u8, n: usize, len: u16) -> Vec<u8> {
    let mut v = Vec::new();
    for _ in 0..n {
        v.extend([kind, 3, 3]);
        v.extend(len.to_be_bytes());
        v.extend(std::iter::repeat_n(0x5a, usize::from(len)));
    }
    v
}

#[test]
fn a_tls_connection_is_named_and_never_counted() {
    let mut w = Wire::new();
    w.open(SK, 0);
    // ClientHello; the server's flight; the client's Finished and its
    // encrypted request; the encrypted response in several records.
    w.recv(SK, T0, 517);
    w.send(SK, T0 + ms(1), &records(22, 3, 120));
    w.recv(SK, T0 + ms(5), 80);
    w.recv(SK, T0 + ms(6), 300);
    for i in 0..5 {
        w.send(SK, T0 + ms(30 + i), &records(23, 1, 60));
    }
    // A second request on the connection, its response in one send.
    w.recv(SK, T0 + ms(100), 300);
    w.send(SK, T0 + ms(130), &records(23, 2, 900));
    w.close(SK, T0 + ms(200));
    let rs = w.drain(ms(10_000));
    assert!(rs.len() >= 2, "{rs:#?}");
    for r in &rs {
        assert_eq!(
            (r.framing, r.outcome),
            (Some(Framing::Tls), Outcome::TlsUnsupported),
            "{r:#?}"
        );
        assert_eq!(r.observations().count(), 0, "not a request's figures");
        assert_eq!((r.t_first_token_ns, r.ttft_ns), (None, None), "{r:#?}");
    }
    let json = serde_json::to_string(&rs[0]).expect("json");
    assert!(json.contains("\"framing\":\"tls\""), "{json}");
    assert!(json.contains("\"outcome\":\"tls_unsupported\""), "{json}");
}
