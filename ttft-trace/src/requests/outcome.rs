//! How a request ended: decided by the connection's state machine,
//! reported in each request's record and counted by outcome.

use serde::{Serialize, Serializer};

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// A whole response with a status below 400.
    Ok,
    /// A whole response with status 400 or above.
    ErrorStatus,
    /// The connection closed (FIN or RST either way, or the client's EOF)
    /// while the framing said the response was still going, or the client
    /// closed first during a body that ends at the (server's) close.
    ClosedMidResponse,
    /// The connection closed before any response byte was sent.
    ClosedBeforeResponse,
    /// HTTP/1.1 pipelining: the client sent a request before the previous
    /// response ended. Both requests get this outcome; their responses
    /// cannot be told apart from send sizes alone.
    PipelinedUnsupported,
    /// A request on an HTTP/2 connection: its streams are multiplexed, so
    /// one "request" is an idle-to-busy period of the connection, not a
    /// request. Logged (`framing: "http2"`), never counted.
    Http2Unsupported,
    /// An HTTP/2 stream ended by RST_STREAM from either side (the record
    /// says which, and the error code).
    Reset,
    /// An HTTP/2 stream above the last stream id of a GOAWAY: not
    /// processed by the server.
    GoAway,
    /// A request on a TLS connection (the server's first send was TLS
    /// records): its bytes are encrypted, and the plaintext is not read
    /// (TLS libraries are not probed yet). Logged (`framing: "tls"`), never
    /// counted: its sends are records, not tokens.
    TlsUnsupported,
    /// Still in flight when tracing stopped.
    InFlightAtExit,
    /// Its connection was dropped to bound memory (idle too long without a
    /// close, usually a lost close event).
    Evicted,
}

impl Outcome {
    pub const ALL: [Outcome; 11] = [
        Self::Ok,
        Self::ErrorStatus,
        Self::ClosedMidResponse,
        Self::ClosedBeforeResponse,
        Self::PipelinedUnsupported,
        Self::Http2Unsupported,
        Self::Reset,
        Self::GoAway,
        Self::TlsUnsupported,
        Self::InFlightAtExit,
        Self::Evicted,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::ErrorStatus => "error_status",
            Self::ClosedMidResponse => "closed_mid_response",
            Self::ClosedBeforeResponse => "closed_before_response",
            Self::PipelinedUnsupported => "pipelined_unsupported",
            Self::Http2Unsupported => "http2_unsupported",
            Self::Reset => "reset",
            Self::GoAway => "goaway",
            Self::TlsUnsupported => "tls_unsupported",
            Self::InFlightAtExit => "in_flight_at_exit",
            Self::Evicted => "evicted",
        }
    }

    /// Whether the request ended without its whole response in a way its
    /// client may retry (`requests/retries.rs`): reset, refused by a
    /// GOAWAY, or its connection closed before or during the response.
    pub(super) fn interrupted(self) -> bool {
        matches!(
            self,
            Self::Reset | Self::GoAway | Self::ClosedMidResponse | Self::ClosedBeforeResponse
        )
    }

    /// Whether the time to the first token (and its breakdown and the gaps
    /// between chunks) is a real serving figure: the response started
    /// normally, whether or not it ended.
    pub(super) fn first_token_counts(self) -> bool {
        matches!(
            self,
            Self::Ok | Self::ClosedMidResponse | Self::Reset | Self::InFlightAtExit
        )
    }
}

impl Serialize for Outcome {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}
