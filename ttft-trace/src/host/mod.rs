//! The host, as the daemon reads it: the target's root filesystem, its
//! processes and ports, sockets by netlink, capabilities, clocks, tracefs and
//! cgroups. Nothing here knows of requests or GPUs; the layers above ask.

pub mod caps;
pub mod cgroups;
pub mod clock;
pub mod deadline;
pub mod kubelet;
pub mod own_files;
pub mod ports;
pub mod rootfs;
pub mod sock_diag;
pub mod targets;
pub mod tracefs;
