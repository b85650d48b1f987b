//! Linux capabilities: this process's effective set (from `/proc/self/status`),
//! what ttft-trace needs of it and why, and messages naming what is missing.
//!
//! Measured on Linux 6.18 (docs/deployment.md): loading the programs needs
//! CAP_BPF and CAP_PERFMON, creating uprobes needs CAP_SYS_ADMIN (since Linux
//! 6.13, commit ba677dbe77af, backported to the stable kernels), and
//! CAP_SYS_ADMIN implies the other two. Reaching other users' processes needs
//! CAP_SYS_PTRACE, and their files CAP_DAC_READ_SEARCH.

use std::fmt;

/// One capability: its number (bit in the `Cap*` masks) and name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cap {
    pub number: u8,
    pub name: &'static str,
}

impl fmt::Display for Cap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

const fn cap(number: u8, name: &'static str) -> Cap {
    Cap { number, name }
}

pub const CAP_DAC_READ_SEARCH: Cap = cap(2, "CAP_DAC_READ_SEARCH");
pub const CAP_SYS_PTRACE: Cap = cap(19, "CAP_SYS_PTRACE");
pub const CAP_SYS_ADMIN: Cap = cap(21, "CAP_SYS_ADMIN");
pub const CAP_SYS_RESOURCE: Cap = cap(24, "CAP_SYS_RESOURCE");
pub const CAP_PERFMON: Cap = cap(38, "CAP_PERFMON");
pub const CAP_BPF: Cap = cap(39, "CAP_BPF");

/// A capability set, as the hex masks of `/proc/PID/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CapSet(pub u64);

impl CapSet {
    /// The set of one `Cap*:` line (`CapEff`, `CapBnd`, ...) of a status text.
    pub fn parse_status(status: &str, field: &str) -> Option<CapSet> {
        status.lines().find_map(|line| {
            let value = line.strip_prefix(field)?.strip_prefix(':')?;
            u64::from_str_radix(value.trim(), 16).ok().map(CapSet)
        })
    }

    /// This process's effective set.
    pub fn effective() -> std::io::Result<CapSet> {
        let status = std::fs::read_to_string("/proc/self/status")?;
        Self::parse_status(&status, "CapEff").ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "no CapEff line in /proc/self/status",
            )
        })
    }

    pub fn has(self, cap: Cap) -> bool {
        cap.number < 64 && self.0 & (1u64 << cap.number) != 0
    }
}

/// Something ttft-trace does that needs a capability: any one of `any_of`.
#[derive(Debug, Clone, Copy)]
pub struct Need {
    pub any_of: &'static [Cap],
    pub why: &'static str,
    /// Without it nothing can be traced; otherwise only some targets fail.
    pub always: bool,
}

/// Loading the eBPF programs and attaching them: [`Need`]s that hold for any target.
pub const LOAD: &[Need] = &[
    Need {
        any_of: &[CAP_BPF, CAP_SYS_ADMIN],
        why: "bpf(2): create the maps and load the programs",
        always: true,
    },
    Need {
        any_of: &[CAP_PERFMON, CAP_SYS_ADMIN],
        why: "load tracing programs (they read user memory) and attach them to tracepoints",
        always: true,
    },
];

/// Creating uprobes (perf_event_open of the uprobe PMU): CAP_SYS_ADMIN since
/// Linux 6.13 and its stable backports, CAP_PERFMON on older kernels.
pub const UPROBES: Need = Need {
    any_of: &[CAP_SYS_ADMIN],
    why: "create uprobes on the CUDA libraries (Linux 6.13+ and stable backports refuse \
          perf_event_open of the uprobe PMU without it; older kernels take CAP_PERFMON)",
    always: true,
};

/// Reaching the traced processes and their files.
pub const TARGETS: &[Need] = &[
    Need {
        any_of: &[CAP_SYS_PTRACE],
        why: "read /proc/PID/maps, /proc/PID/fd and /proc/PID/root of processes of other users, \
              or with capabilities the tracer lacks",
        always: false,
    },
    Need {
        any_of: &[CAP_DAC_READ_SEARCH],
        why: "open the libraries a target maps when their directories are closed to the tracer \
              (a venv under a 0700 home), and read tracefs as a non-root user",
        always: false,
    },
];

/// Every need, in the order `check` reports them.
pub fn all_needs() -> Vec<Need> {
    let mut v = LOAD.to_vec();
    v.push(UPROBES);
    v.extend_from_slice(TARGETS);
    v
}

impl Need {
    pub fn met(&self, set: CapSet) -> bool {
        self.any_of.iter().any(|c| set.has(*c))
    }

    /// "CAP_BPF (or CAP_SYS_ADMIN)".
    pub fn caps_text(&self) -> String {
        match self.any_of {
            [] => String::new(),
            [one] => one.name.to_string(),
            [first, rest @ ..] => {
                let rest: Vec<&str> = rest.iter().map(|c| c.name).collect();
                format!("{} (or {})", first.name, rest.join(" or "))
            }
        }
    }
}

/// The needs of `needs` that `set` does not meet.
pub fn missing(set: CapSet, needs: &[Need]) -> Vec<Need> {
    needs.iter().filter(|n| !n.met(set)).copied().collect()
}

/// A one-paragraph error for missing needs, clear for a plain user too.
pub fn missing_message(set: CapSet, missing: &[Need]) -> String {
    let list: Vec<String> = missing
        .iter()
        .map(|n| format!("{} to {}", n.caps_text(), n.why))
        .collect();
    let who = if set.0 == 0 {
        "this process has no capabilities (run it as root, or give it these)"
    } else {
        "this process lacks them"
    };
    format!(
        "ttft-trace needs {}; {who}. `ttft-trace check` lists what this host needs",
        list.join(", and ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATUS: &str = "Name:\tcat\nCapInh:\t0000000000000000\nCapPrm:\t000001fffeffffff\n\
                          CapEff:\t000001fffeffffff\nCapBnd:\t000001fffeffffff\nCapAmb:\t0000000000000000\n";

    #[test]
    fn parses_cap_lines() {
        let eff = CapSet::parse_status(STATUS, "CapEff").expect("CapEff");
        assert_eq!(eff, CapSet(0x1ff_feff_ffff));
        assert!(eff.has(CAP_BPF) && eff.has(CAP_PERFMON) && eff.has(CAP_SYS_ADMIN));
        // Bit 24 is clear in this mask.
        assert!(!eff.has(CAP_SYS_RESOURCE));
        assert_eq!(CapSet::parse_status(STATUS, "CapAmb"), Some(CapSet(0)));
        assert_eq!(CapSet::parse_status(STATUS, "CapNope"), None);
        assert_eq!(CapSet::parse_status("CapEff:\tzz\n", "CapEff"), None);
    }

    #[test]
    fn sys_admin_meets_the_load_needs() {
        let admin = CapSet(1 << CAP_SYS_ADMIN.number);
        assert!(missing(admin, LOAD).is_empty());
        assert!(UPROBES.met(admin));
        let split = CapSet((1 << CAP_BPF.number) | (1 << CAP_PERFMON.number));
        assert!(missing(split, LOAD).is_empty());
        assert!(!UPROBES.met(split));
    }

    #[test]
    fn messages_name_the_missing_capability() {
        let only_bpf = CapSet(1 << CAP_BPF.number);
        let m = missing(only_bpf, LOAD);
        assert_eq!(m.len(), 1);
        let text = missing_message(only_bpf, &m);
        assert!(text.contains("CAP_PERFMON (or CAP_SYS_ADMIN)"), "{text}");
        assert!(!text.contains("CAP_BPF"), "{text}");
        let none = missing_message(CapSet(0), &missing(CapSet(0), LOAD));
        assert!(none.contains("run it as root"), "{none}");
        assert!(
            none.contains("CAP_BPF") && none.contains("CAP_PERFMON"),
            "{none}"
        );
    }
}
