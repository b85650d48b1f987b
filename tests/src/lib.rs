pub mod fixtures;
pub mod tracer;
