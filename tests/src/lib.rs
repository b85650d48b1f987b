pub mod demo;
pub mod fixtures;
pub mod tracer;
