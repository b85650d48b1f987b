//! Per-request correlation: a traced server's own socket traffic turned
//! into requests, each joined to the GPU episode that produced its first
//! token. Pure code over decoded events: no kernel, no clock, no I/O.
//!
//! # The request timeline
//!
//! Per server connection (keyed by the socket's kernel address; one opened
//! before tracing began is adopted at its next request, from the request's
//! first segment: `connections_adopted`):
//!
//! - `t_arrive`: return of the first receive after the connection was
//!   idle. More receives before any response byte (a request body in
//!   several reads) belong to the same request.
//! - `t_first_byte`: return of the first send of the response. An
//!   informational response (`100 Continue`, `103 Early Hints`) is not the
//!   response: it is skipped, and the request body that follows it still
//!   belongs to the request.
//! - `t_first_token`: return of the first send that carries body rather
//!   than only HTTP headers. The captured head of the response's first
//!   send gives the header length: if that send moved more bytes, it
//!   carries body; otherwise the first later send that does is the first
//!   token. Every body send is a *chunk*; with `Transfer-Encoding:
//!   chunked`, only a send that carries chunk data is: one of only framing
//!   (a size line, the CRLF after a chunk, the zero-size chunk, trailers,
//!   the final CRLF, in any pieces) is not (see `requests/chunked.rs`).
//! - `t_done`: return of the last send of the response. The response ends
//!   when `Content-Length` bytes after the headers have been sent, or when
//!   the chunked body's end is read (split across sends at any byte); a
//!   body without length or chunking (HTTP/1.0, `Connection: close`) ends
//!   at the server's close and is complete (`ok`); if the client closes
//!   first (its FIN, or a receive returning EOF), it left:
//!   `closed_mid_response`. When the framing cannot tell
//!   (opaque, HTTP/2, a tail not captured), the response ends at the next
//!   receive, the close, or after `response_quiet_ns` without a send.
//!
//! # Figures (as `vllm bench serve` defines them)
//!
//! - **TTFT** = `t_first_token - t_arrive`.
//! - **ITL**: every gap between consecutive chunks (JSONL list capped at
//!   `itl_cap`, 4096 by default).
//! - **E2E** = `t_done - t_arrive`, for responses that ended.
//! - **TPOT** = `(E2E - TTFT) / (chunks - 1)` when chunks > 1.
//! - **queue / GPU / egress**: the episode that produced the first token is
//!   the last one whose device-to-host copy completed in
//!   `[t_arrive, t_first_token]`, in any process of the tree. queue =
//!   `t_arrive` to its first launch (0 if it launched before arrival: the
//!   request joined a running batch, note `joined_running_batch`, and its
//!   GPU part then counts from arrival); GPU = from there to D2H done;
//!   egress = D2H done to `t_first_token`. The three add up to TTFT
//!   exactly. No episode in the window (a cached response, GPU work not
//!   traced): no breakdown, note `no_gpu_episode`.
//! - **Client TTFT estimate**: first token acknowledged by the client −
//!   the request's first segment arrived, from `tcp:tcp_probe` on the same
//!   socket (see `requests/delivery.rs`); `None` when either was not seen. A request
//!   is held up to `ack_wait_ns` for that ACK. A connection is followed past
//!   its close until the kernel is done with it (or `ack_wait_ns`): when
//!   the ACK came after the server's close, where `tcp_probe` does not see
//!   it, the state change that says everything sent was acknowledged
//!   stands for it (note `first_token_acked_by_close`: no later than), if
//!   no segment arrived between the first token and the close (that one
//!   may have been the ACK, unseen: then the delivery is unknown).
//! - **Chunk deliveries**: every body send's ACK, the same way
//!   (`requests/chunk_delivery.rs`): `t_first_chunk_acked_ns` and the gaps
//!   between consecutive chunks' ACKs (`chunk_ack_gaps_ns`), what stalls on
//!   the wire are found in. A finished request is held up to
//!   `chunk_ack_wait_ns` (1 s) after its last send for its chunks' ACKs
//!   (no longer than it must: at once when all came).
//! - `gpu_steps_waited`: episodes completed in `[t_arrive, t_first_token]`;
//!   `gpu_idle_before_start_ns`: time in `[t_arrive, t_gpu_start]` covered
//!   by no episode's `[launch, D2H done]`.
//!
//! # Where the figures can be fooled
//!
//! - Times are at the *return* of the server's socket calls, not on the
//!   wire: a send that blocks on a full socket buffer is stamped late.
//! - TLS hides the headers: every send is body (`framing: "opaque"`), so a
//!   headers-only flush counts as the first token and TTFT reads short.
//! - HTTP/2 (or any multiplexing) puts several requests on one connection
//!   at once. Where the kernel walks a clear-text connection's frames (its
//!   preface seen, the client's segments seen at the workload's cgroup),
//!   each client stream is a request (`requests/streams.rs`). Otherwise a
//!   clear-text HTTP/2 connection (the server's SETTINGS preface, or a 101
//!   to `h2c`) is only recognised: its "requests" (one per idle-to-busy
//!   period) get `framing: "http2"`, outcome `http2_unsupported`, and no
//!   figures. Over TLS it is opaque, and meaningless.
//! - Only the first sends after a receive carry a head; later ones show 8
//!   bytes of tail. A chunked body is followed exactly while its bytes are
//!   seen or its chunk sizes say where the next boundary is; past a size
//!   line not seen, its end is read from the last bytes of the stream and
//!   every send is taken as a chunk unless it reads as framing only. Trailer
//!   lines longer than the tail are not seen then: with `Trailer`
//!   announced, the end falls back to the close or the next request.
//! - A role-only SSE chunk (`{"delta":{"role":"assistant"}}`) or any
//!   keep-alive comment sent before the first real token is body, so it
//!   is taken as the first token: TTFT reads short.
//! - Chunks are sends, not tokens: a server that sends several tokens per
//!   send (or the `data: [DONE]` event alone) skews ITL and TPOT.
//! - Several requests in one GPU step share its episode; with tensor
//!   parallelism every rank's episode counts in `gpu_steps_waited`.
//! - If the server runs further steps between the token's D2H copy and its
//!   send, a later step is taken: GPU shifts later and egress reads short.
//! - The method of a request is not seen: a `HEAD` response announcing a
//!   body length looks incomplete, and the next request on the connection
//!   is then counted as pipelined.
//! - A response whose end the framing cannot tell is ended after
//!   `response_quiet_ns` (5 s) without a send: an opaque stream that
//!   pauses longer is cut there, its later sends counted as
//!   `sends_without_request`.
//! - A client that half-closes after its request (`shutdown(SHUT_WR)`)
//!   looks like a close: `closed_before_response`.
//! - A header block longer than the capture leaves the header end unknown:
//!   the first send is taken as headers alone (note
//!   `header_end_not_captured`); no head at all is read as opaque (note
//!   `head_not_captured`).
//!
//! # Notes (JSONL `notes`)
//!
//! `joined_running_batch`, `no_gpu_episode`, `itl_truncated`,
//! `header_end_not_captured`, `head_not_captured`, `end_by_idle` (the
//! response's end was taken after `response_quiet_ns` without a send),
//! `first_token_acked_by_close`, `chunks_acked_by_close` (some chunks'
//! ACKs dated by the close, see `chunk_ack_gap_by_close`),
//! `chunk_acks_incomplete` (some chunk's ACK was not seen: the connection
//! ended first, the record's wait for it ended, or
//! `chunk_delivery::MAX_PENDING_CHUNKS` waited).

mod chunk_delivery;
mod chunked;
mod connection;
mod correlator;
mod delivery;
mod header_blocks;
mod http;
mod join;
mod outcome;
mod record;
mod response;
mod retries;
pub mod stream_end;
pub mod stream_stalls;
mod streams;
mod summary;
mod tls;

pub use correlator::{Correlator, CorrelatorConfig, CorrelatorStats, ends_socket};
pub(crate) use join::{EpisodeHistory, Join};
pub use outcome::Outcome;
pub use record::{Figure, RequestRecord};
pub use response::Framing;
pub use retries::{AttemptId, RequestId};
pub use summary::RequestRecorders;
pub use tls::{TlsFacts, TlsVersion};

#[cfg(test)]
mod tests;
