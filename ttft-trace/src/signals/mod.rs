//! The signals that explain slow requests (scheduler intervals, TCP trouble,
//! large copies): kept per window for attribution, and exported.

mod metrics;
mod store;

pub use metrics::SignalMetrics;
pub use store::{Copies, KEEP_NS, Overlap, SignalStore};
