//! Workloads: what the daemon discovers and names. A workload is a process
//! tree serving inference (its root found by [`discover::workload_root`]),
//! traced as one unit: its requests join only its own GPU episodes, and its
//! series carry its labels ([`labels::WorkloadLabels`]).

pub mod discover;
pub mod labels;
pub mod quota;

pub use discover::Filters;
pub use labels::{ClaimVerdict, LabelSets, Naming, PodClaim, ProcessSeen, WorkloadLabels};
