pub mod container;
pub mod demo;
pub mod faults;
pub mod fixtures;
pub mod prometheus;
pub mod stalls;
pub mod stub_gpu;
pub mod tracer;
