//! A TLS connection's handshake as the wire shows it, whatever library
//! terminates it (OpenSSL, GnuTLS, rustls, Go's `crypto/tls`): nothing but
//! when the client's flights arrived and what the server's first send of
//! each flight begins with. No plaintext is needed, and none is read.
//!
//! The server's first flight starts with its `ServerHello` in the clear
//! (RFC 8446 §4.1.3; RFC 5246 §7.4.1.3): the version negotiated (the
//! `supported_versions` extension, or the legacy field before TLS 1.3), a
//! `HelloRetryRequest` (its fixed random), and whether a session is resumed
//! (TLS 1.3: a `pre_shared_key` extension; TLS 1.2: the server's flight
//! goes on with `ChangeCipherSpec` or a `NewSessionTicket` instead of its
//! certificate). From the server's side the handshake is over when:
//!
//! - TLS 1.3, and a resumed TLS 1.2: the client's last flight (its
//!   `Finished`) arrives, the first client bytes after the server's flight;
//! - a full TLS 1.2 handshake: the server sends its `ChangeCipherSpec` and
//!   `Finished` after the client's key exchange.
//!
//! A TLS 1.2 flight whose next message lies beyond the captured head is
//! resolved by the server's send after the client's next flight: more
//! handshake (`ChangeCipherSpec`, a ticket) for a full handshake, already
//! application data for a resumed one.
//!
//! The handshake's duration is from the `ClientHello`'s arrival (the
//! connection's first client bytes: the segment's arrival where
//! `tcp_probe` saw it, else the receive) to that end. A connection adopted
//! after its opening, or whose server's first send is not a `ServerHello`,
//! gets no handshake figures.

/// Record content types (RFC 8446 §5.1).
const CHANGE_CIPHER_SPEC: u8 = 20;
const HANDSHAKE: u8 = 22;
const APPLICATION_DATA: u8 = 23;

/// What a send of application data records begins with on the wire: where
/// a send's captured head is its plaintext (one inside `SSL_write`), the
/// handshake is told what the wire carried.
pub(crate) const APPLICATION_DATA_HEAD: [u8; 3] = [APPLICATION_DATA, 3, 3];

/// Handshake message types (RFC 8446 §4, RFC 5246 §7.4).
const SERVER_HELLO: u8 = 2;
const NEW_SESSION_TICKET: u8 = 4;
const CERTIFICATE: u8 = 11;
const SERVER_KEY_EXCHANGE: u8 = 12;
const CERTIFICATE_REQUEST: u8 = 13;
const SERVER_HELLO_DONE: u8 = 14;

/// Extension types.
const EXT_PRE_SHARED_KEY: u16 = 41;
const EXT_SUPPORTED_VERSIONS: u16 = 43;
const EXT_KEY_SHARE: u16 = 51;

/// `ServerHello.random` of a `HelloRetryRequest`: SHA-256 of the string
/// "HelloRetryRequest" (RFC 8446 §4.1.3).
const HELLO_RETRY_RANDOM: [u8; 32] = [
    0xcf, 0x21, 0xad, 0x74, 0xe5, 0x9a, 0x61, 0x11, 0xbe, 0x1d, 0x8c, 0x02, 0x1e, 0x65, 0xb8, 0x91,
    0xc2, 0xa2, 0x11, 0x16, 0x7a, 0xbb, 0x8c, 0x5e, 0x07, 0x9e, 0x09, 0xe2, 0xc8, 0xa8, 0x33, 0x9c,
];

/// The protocol version a connection negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TlsVersion {
    Tls10,
    Tls11,
    Tls12,
    Tls13,
}

impl TlsVersion {
    pub const ALL: [TlsVersion; 4] = [Self::Tls10, Self::Tls11, Self::Tls12, Self::Tls13];

    fn from_wire(v: u16) -> Option<Self> {
        match v {
            0x0301 => Some(Self::Tls10),
            0x0302 => Some(Self::Tls11),
            0x0303 => Some(Self::Tls12),
            0x0304 => Some(Self::Tls13),
            _ => None,
        }
    }

    /// As JSONL, OTLP and the metric label write it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tls10 => "1.0",
            Self::Tls11 => "1.1",
            Self::Tls12 => "1.2",
            Self::Tls13 => "1.3",
        }
    }
}

/// What a server's first flight says in the clear.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ServerHello {
    pub version: TlsVersion,
    /// A `HelloRetryRequest`: the client sends another `ClientHello`.
    pub retry: bool,
    /// `None`: what would tell lies beyond the captured bytes.
    pub resumed: Option<bool>,
}

/// Reads a `ServerHello` from the captured first bytes of a server's send
/// (`None`: not one, or cut before its version is known).
pub(crate) fn server_hello(head: &[u8]) -> Option<ServerHello> {
    let record = head.get(..5)?;
    if record[0] != HANDSHAKE || record[1] != 3 || *head.get(5)? != SERVER_HELLO {
        return None;
    }
    let record_end = 5 + usize::from(u16::from_be_bytes([record[3], record[4]]));
    let msg_len = be24(head.get(6..9)?);
    let body = &head[9..];
    let legacy = u16::from_be_bytes([*body.first()?, *body.get(1)?]);
    let retry = body.get(2..34)? == HELLO_RETRY_RANDOM;
    // After the random: the session id, the cipher suite (2 bytes), the
    // compression method (1), then the extensions' length (2), if any.
    let ext_at = 35 + usize::from(*body.get(34)?) + 3;
    let walk = if ext_at + 2 <= msg_len {
        let len = u16::from_be_bytes([*body.get(ext_at)?, *body.get(ext_at + 1)?]);
        Some(Extensions::walk(body, ext_at + 2, usize::from(len)))
    } else {
        None
    };
    let version = match walk {
        Some(w) if w.version.is_some() => w.version,
        // Only a TLS 1.3 ServerHello carries a key share: rustls writes it
        // before supported_versions, which a post-quantum share pushes past
        // the capture.
        Some(w) if w.key_share => Some(0x0304),
        // No supported_versions: the legacy field is the version, unless
        // the extension may lie beyond the capture.
        Some(w) if !w.complete => None,
        _ => Some(legacy),
    };
    let version = TlsVersion::from_wire(version?)?;
    let resumed = match version {
        TlsVersion::Tls13 if retry => Some(false),
        TlsVersion::Tls13 => walk.and_then(Extensions::resumed),
        _ => tls12_resumed(head, record_end, 9 + msg_len),
    };
    Some(ServerHello {
        version,
        retry,
        resumed,
    })
}

fn be24(b: &[u8]) -> usize {
    b.iter().fold(0, |n, &x| n << 8 | usize::from(x))
}

/// What the `ServerHello`'s extensions in sight say.
#[derive(Debug, Clone, Copy, Default)]
struct Extensions {
    /// `supported_versions`' choice.
    version: Option<u16>,
    key_share: bool,
    pre_shared_key: bool,
    /// Every extension's header was in sight.
    complete: bool,
    /// Bytes of extensions after the last header in sight.
    unseen: usize,
}

impl Extensions {
    /// Walks the headers of the extensions at `body[at..at + len]` that are
    /// in sight (a body may lie beyond the capture: it is skipped by its
    /// length).
    fn walk(body: &[u8], at: usize, len: usize) -> Self {
        let end = at + len;
        let mut x = Self::default();
        let mut o = at;
        while o + 4 <= end {
            let Some(h) = body.get(o..o + 4) else {
                x.unseen = end - o;
                return x;
            };
            let kind = u16::from_be_bytes([h[0], h[1]]);
            let n = usize::from(u16::from_be_bytes([h[2], h[3]]));
            match kind {
                EXT_SUPPORTED_VERSIONS if n == 2 => {
                    x.version = body
                        .get(o + 4..o + 6)
                        .map(|v| u16::from_be_bytes([v[0], v[1]]));
                }
                EXT_KEY_SHARE => x.key_share = true,
                EXT_PRE_SHARED_KEY => x.pre_shared_key = true,
                _ => {}
            }
            o += 4 + n;
        }
        x.complete = o == end;
        x
    }

    /// A TLS 1.3 `ServerHello` resumes a session when it carries
    /// `pre_shared_key`. The only extensions it may carry are that one,
    /// `supported_versions` and `key_share` (RFC 8446 §4.2): once the other
    /// two were seen, bytes past the capture can only be a
    /// `pre_shared_key` (OpenSSL writes it last, after a key share that a
    /// post-quantum group makes over a kilobyte).
    fn resumed(self) -> Option<bool> {
        // Each of the two other extensions is 6 bytes (its header, a
        // version or an identity index).
        match (
            self.pre_shared_key,
            self.complete,
            self.key_share,
            self.version,
        ) {
            (true, _, _, _) => Some(true),
            (false, true, _, _) => Some(false),
            (false, false, true, Some(_)) => Some(self.unseen > 0),
            (false, false, true, None) => match self.unseen {
                6 => Some(false),
                12 => Some(true),
                _ => None,
            },
            _ => None,
        }
    }
}

/// A TLS 1.2 (or older) server's flight after its `ServerHello`: an
/// abbreviated handshake goes on with `ChangeCipherSpec` (or a
/// `NewSessionTicket` first), a full one with the server's certificate or
/// key exchange (RFC 5246 §7.3, RFC 5077 §3.1). `record_end` ends the
/// `ServerHello`'s record, `hello_end` the message.
fn tls12_resumed(head: &[u8], record_end: usize, hello_end: usize) -> Option<bool> {
    let message = if hello_end < record_end {
        *head.get(hello_end)?
    } else if hello_end == record_end {
        match *head.get(record_end)? {
            CHANGE_CIPHER_SPEC => return Some(true),
            HANDSHAKE => *head.get(record_end + 5)?,
            _ => return None,
        }
    } else {
        // The message goes on in another record.
        return None;
    };
    match message {
        NEW_SESSION_TICKET => Some(true),
        CERTIFICATE | SERVER_KEY_EXCHANGE | CERTIFICATE_REQUEST | SERVER_HELLO_DONE => Some(false),
        _ => None,
    }
}

/// Where a connection's handshake is, from the server's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Opened; the client has not spoken.
    AwaitClientHello,
    /// The `ClientHello` arrived; the server's answer is awaited.
    AwaitServerHello,
    /// A `HelloRetryRequest` was sent: the client's second `ClientHello`.
    AwaitSecondHello,
    /// TLS 1.3 or a resumed TLS 1.2: the client's `Finished` ends it.
    AwaitClientFinished,
    /// TLS 1.2, full or not known yet: the client's key exchange.
    AwaitClientKeyExchange,
    /// TLS 1.2: the client's flight arrived at `t_client`; the server's
    /// next send tells a full handshake (its `Finished`) from a resumed
    /// one (already application data).
    AwaitServerFinished {
        t_client: u64,
    },
    Done {
        t_end: u64,
    },
    /// Not a TLS handshake the wire can follow (not TLS, or a
    /// `ServerHello` cut before its version).
    Unknown,
}

/// A connection's TLS handshake, fed with the client's arrivals and the
/// server's sends in time order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Handshake {
    phase: Phase,
    t_hello: u64,
    hello: Option<ServerHello>,
    retried: bool,
    /// A record carried the handshake's duration into the histogram.
    counted: bool,
}

/// What a request's record says of its connection's TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct TlsFacts {
    #[serde(serialize_with = "version_str")]
    pub version: TlsVersion,
    pub resumed: Option<bool>,
    /// The `ClientHello`'s arrival to the handshake's end; `None` until it
    /// ended.
    pub handshake_ns: Option<u64>,
    pub hello_retry: bool,
    /// The first record of the connection finished after the handshake
    /// ended: the one whose `handshake_ns` the histogram and the report
    /// count (once per connection). Which request's wait includes the
    /// handshake needs the plaintext: its bytes and the `Finished`'s can
    /// share a receive.
    #[serde(rename = "handshake_counted")]
    pub counted: bool,
}

fn version_str<S: serde::Serializer>(v: &TlsVersion, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(v.as_str())
}

impl Handshake {
    /// A connection seen from its opening.
    pub fn new() -> Self {
        Self {
            phase: Phase::AwaitClientHello,
            t_hello: 0,
            hello: None,
            retried: false,
            counted: false,
        }
    }

    /// The server received client bytes, whose segments arrived from
    /// `t_first` to `t_last` (both the receive's time where no segment was
    /// seen). A flight is timed by its first segment when it opens the
    /// handshake and by its last when it ends it: a retransmitted copy of an
    /// earlier flight arrives as a segment too, but is never received.
    pub fn on_client(&mut self, t_first: u64, t_last: u64) {
        self.phase = match self.phase {
            Phase::AwaitClientHello => {
                self.t_hello = t_first;
                Phase::AwaitServerHello
            }
            Phase::AwaitSecondHello => Phase::AwaitServerHello,
            Phase::AwaitClientFinished => Phase::Done { t_end: t_last },
            Phase::AwaitClientKeyExchange => Phase::AwaitServerFinished { t_client: t_last },
            p => p,
        };
    }

    /// The server sent at `t_ns`; `head` is the send's captured first
    /// bytes (empty when not captured).
    pub fn on_server(&mut self, t_ns: u64, head: &[u8]) {
        self.phase = match self.phase {
            Phase::AwaitServerHello => match server_hello(head) {
                Some(h) if h.retry && self.retried => Phase::Unknown,
                Some(h) => {
                    self.hello = Some(h);
                    self.retried |= h.retry;
                    if h.retry {
                        Phase::AwaitSecondHello
                    } else if h.version == TlsVersion::Tls13 || h.resumed == Some(true) {
                        Phase::AwaitClientFinished
                    } else {
                        Phase::AwaitClientKeyExchange
                    }
                }
                None => Phase::Unknown,
            },
            // The server spoke first: not a TLS server.
            Phase::AwaitClientHello => Phase::Unknown,
            Phase::AwaitServerFinished { t_client } => match head.first() {
                Some(&CHANGE_CIPHER_SPEC | &HANDSHAKE) => {
                    self.set_resumed(false);
                    Phase::Done { t_end: t_ns }
                }
                Some(&APPLICATION_DATA) => {
                    self.set_resumed(true);
                    Phase::Done { t_end: t_client }
                }
                _ => Phase::Unknown,
            },
            p => p,
        };
    }

    /// Whether the handshake is under way: begun or awaited, and neither
    /// ended nor given up on.
    pub fn in_progress(&self) -> bool {
        !matches!(self.phase, Phase::Done { .. } | Phase::Unknown)
    }

    fn set_resumed(&mut self, resumed: bool) {
        if let Some(h) = self.hello.as_mut() {
            h.resumed = Some(resumed);
        }
    }

    /// What a request finishing now reports; `None` when the wire showed
    /// no `ServerHello`. The first one after the handshake ended is the one
    /// counted.
    pub(crate) fn facts(&mut self) -> Option<TlsFacts> {
        let hello = self.hello?;
        let done = matches!(self.phase, Phase::Done { .. });
        let counted = done && !self.counted;
        self.counted |= done;
        Some(TlsFacts {
            version: hello.version,
            resumed: hello.resumed,
            handshake_ns: match self.phase {
                Phase::Done { t_end } => Some(t_end.saturating_sub(self.t_hello)),
                _ => None,
            },
            hello_retry: self.retried,
            counted,
        })
    }
}

#[cfg(test)]
#[path = "tls_tests.rs"]
pub(super) mod tests;
