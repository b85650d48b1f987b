//! The /proc files of a traced process that the daemon parses: its maps,
//! its network namespace's listening sockets, its cgroup (and the names of
//! the kubelet's pod log directory its pod UID is looked up in), status
//! and stat.
//! Their contents are the process's to shape (a comm with spaces and
//! parentheses, a path with newlines): never a panic.

#![no_main]

use libfuzzer_sys::fuzz_target;
use ttft_trace::{
    host::{
        cgroups::{container_id, parse_cgroup, pod_uid},
        kubelet::parse_entry,
        ports::parse_listeners,
        targets::{parent_from_stat, status_field},
    },
    probes::libraries::parse_maps,
};

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    match which % 4 {
        0 => {
            let _ = parse_maps(1, &text);
        }
        1 => {
            let _ = parse_listeners(&text);
        }
        2 => {
            if let Some(path) = parse_cgroup(&text) {
                let _ = container_id(&path);
                let _ = pod_uid(&path);
            }
            let _ = container_id(&text);
            let _ = pod_uid(&text);
            for name in rest.split(|&b| b == b'\n') {
                let _ = parse_entry(name);
            }
        }
        _ => {
            for key in ["State:", "Tgid:", "PPid:", "NSpid:"] {
                let _ = status_field(&text, key);
            }
            let _ = parent_from_stat(&text);
        }
    }
});
