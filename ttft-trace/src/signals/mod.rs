//! The signals that explain slow requests (scheduler intervals, TCP trouble,
//! large copies): kept per window for attribution, and exported.

mod intervals;
mod store;

use std::collections::VecDeque;

/// Inserts `v` into `q`, kept ordered by `key`, after those with the same
/// key. Events of different CPUs arrive nearly in order, so this is almost
/// always a push at the back.
fn insert_ordered<T>(q: &mut VecDeque<T>, v: T, key: impl Fn(&T) -> u64) {
    let k = key(&v);
    let at = q.partition_point(|e| key(e) <= k);
    q.insert(at, v);
}

pub use store::{Copies, KEEP_NS, Overlap, SignalStore, covered_ns, overlap};
