//! The JSONL file, defined once: one type per kind of line, for the writer
//! (`export::jsonl`), the reader (`report`) and the tests. Every line is a
//! JSON object whose `type` names its kind:
//!
//! - `request`: one per request ([`RequestLine`] as written, [`Request`] as
//!   read back);
//! - `episode`: one per GPU episode (`episodes::EpisodeRecord` as written,
//!   [`Episode`] as read back);
//! - `attach` and `detach`: a library's probes ([`Attach`], [`Detach`]);
//! - `workload`: a workload followed from now on, its labels and what its
//!   processes claim of their pod ([`WorkloadLine`]);
//! - `totals`: the last line of a run ([`Totals`]).
//!
//! Times are CLOCK_MONOTONIC nanoseconds, the clock of `bpf_ktime_get_ns`.
//! A reader skips kinds it does not know: newer tracers may add some.

mod request;
mod run;
#[cfg(test)]
pub(crate) mod tests;

pub use request::{
    Attempt, Cause, Evidence, Request, RequestId, RequestLine, StallWindow, Stalls, Tls, Workload,
};
pub use run::{Attach, Detach, Episode, Totals, WorkloadLine, WorkloadStats};

/// The `type` of each kind of line.
pub mod kind {
    pub const REQUEST: &str = "request";
    pub const EPISODE: &str = "episode";
    pub const ATTACH: &str = "attach";
    pub const DETACH: &str = "detach";
    pub const TOTALS: &str = "totals";
    pub const WORKLOAD: &str = "workload";
}
