//! The signals that explain slow requests (scheduler intervals, TCP trouble,
//! large copies): kept per window for attribution, and exported.

mod intervals;
mod store;

pub use store::{Copies, KEEP_NS, Overlap, SignalStore};
