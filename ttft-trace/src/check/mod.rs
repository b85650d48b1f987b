//! `ttft-trace check`: can this host trace? Each item (kernel, BTF, tracefs,
//! uprobes, every tracepoint the probes use, loading the programs for real, a
//! uprobe that must fire, capabilities, memlock, sysctls, NVML) gets a verdict
//! and, when not ok, the fix. Tracing can work when no item failed.
//!
//! The pure parts (verdicts, parsing, rendering) are here; [`host`] reads the host.

mod hooks;
mod host;
mod quotas;
mod target;

use std::path::PathBuf;

use serde::Serialize;

pub use host::run;

/// How one item stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Works.
    Ok,
    /// Works, with a limit worth knowing (tracing still works).
    Warn,
    /// Tracing cannot work until it is fixed.
    Fail,
}

impl Verdict {
    fn label(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Warn => "warn",
            Verdict::Fail => "FAIL",
        }
    }
}

/// One line of the report.
#[derive(Debug, Clone, Serialize)]
pub struct Item {
    pub name: String,
    pub verdict: Verdict,
    pub detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Item {
    pub fn ok(name: impl Into<String>, detail: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            verdict: Verdict::Ok,
            detail: detail.into(),
            fix: None,
        }
    }

    pub fn warn(
        name: impl Into<String>,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        Self {
            verdict: Verdict::Warn,
            fix: Some(fix.into()),
            ..Self::ok(name, detail)
        }
    }

    pub fn fail(
        name: impl Into<String>,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        Self {
            verdict: Verdict::Fail,
            fix: Some(fix.into()),
            ..Self::ok(name, detail)
        }
    }
}

/// Every item, in order.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    pub items: Vec<Item>,
}

impl Report {
    /// The worst verdict (Ok for an empty report).
    pub fn verdict(&self) -> Verdict {
        self.items
            .iter()
            .map(|i| i.verdict)
            .max()
            .unwrap_or(Verdict::Ok)
    }

    /// Tracing can work: no item failed.
    pub fn can_trace(&self) -> bool {
        self.verdict() != Verdict::Fail
    }

    fn count(&self, v: Verdict) -> usize {
        self.items.iter().filter(|i| i.verdict == v).count()
    }

    /// The last line: the overall answer.
    pub fn summary(&self) -> String {
        let (warn, fail) = (self.count(Verdict::Warn), self.count(Verdict::Fail));
        if fail > 0 {
            format!("tracing cannot work here: {fail} failed, {warn} warning(s)")
        } else {
            format!("tracing can work here ({warn} warning(s))")
        }
    }

    /// The report for a terminal: one line per item, its fix under it.
    pub fn render(&self) -> String {
        let width = self.items.iter().map(|i| i.name.len()).max().unwrap_or(0);
        let mut out = String::new();
        for i in &self.items {
            out.push_str(&format!(
                "{:<4}  {:<width$}  {}\n",
                i.verdict.label(),
                i.name,
                i.detail
            ));
            if let Some(fix) = &i.fix {
                out.push_str(&format!("{:<4}  {:<width$}  fix: {fix}\n", "", ""));
            }
        }
        out.push_str(&self.summary());
        out.push('\n');
        out
    }

    /// The report as one JSON object: `items` and `can_trace`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "items": self.items, "can_trace": self.can_trace() })
    }
}

/// Settings of `check`.
#[derive(Debug, Clone, Default)]
pub struct CheckConfig {
    /// NVML library to try (default: libnvidia-ml.so.1 from the loader's path).
    pub nvml_lib: Option<PathBuf>,
    /// A process to check as a target: what of it would be traced.
    pub pid: Option<u32>,
    /// Each workload's shares, as the daemon's settings file (`--config`)
    /// gives them: then the workloads past one now are looked for (every
    /// process's mappings read: not done by a plain `check`).
    pub shares: Option<crate::config::Quotas>,
}

/// A kernel release's (major, minor, patch) from `uname -r` text
/// (`6.18.44-fc-v657`, `5.15.0-91-generic`, `6.8`).
pub fn parse_release(release: &str) -> Option<(u32, u32, u32)> {
    let mut nums = release.split(['.', '-', '+', '_']).map(|p| {
        let digits: String = p.chars().take_while(char::is_ascii_digit).collect();
        digits.parse::<u32>().ok()
    });
    let major = nums.next()??;
    let minor = nums.next()??;
    let patch = nums.next().flatten().unwrap_or(0);
    Some((major, minor, patch))
}

/// What the tool uses, by the kernel version that brought it.
pub const KERNEL_FEATURES: &[((u32, u32), &str)] = &[
    ((5, 8), "BPF ring buffer, CAP_BPF and CAP_PERFMON"),
    (
        (5, 11),
        "BPF memory charged to the memory cgroup (no RLIMIT_MEMLOCK)",
    ),
    (
        (6, 3),
        "sock:sock_send_length and sock:sock_recv_length tracepoints",
    ),
];

/// The features this kernel version predates.
pub fn features_missing(version: (u32, u32, u32)) -> Vec<&'static str> {
    KERNEL_FEATURES
        .iter()
        .filter(|((maj, min), _)| (version.0, version.1) < (*maj, *min))
        .map(|(_, what)| *what)
        .collect()
}

/// Mount points of tracefs in a `/proc/self/mounts` text.
pub fn tracefs_mounts(mounts: &str) -> Vec<PathBuf> {
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_src, dir, fstype) = (f.next()?, f.next()?, f.next()?);
            (fstype == "tracefs").then(|| PathBuf::from(dir.replace("\\040", " ")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kernel_releases() {
        assert_eq!(parse_release("6.18.44-fc-v657"), Some((6, 18, 44)));
        assert_eq!(parse_release("5.15.0-91-generic"), Some((5, 15, 0)));
        assert_eq!(parse_release("6.8"), Some((6, 8, 0)));
        assert_eq!(parse_release("4.18.0-553.el8_10.x86_64"), Some((4, 18, 0)));
        assert_eq!(parse_release("6.1.0+"), Some((6, 1, 0)));
        assert_eq!(parse_release("linux"), None);
        assert_eq!(parse_release("6"), None);
    }

    #[test]
    fn compares_kernel_versions_with_features() {
        assert!(features_missing((6, 18, 44)).is_empty());
        assert!(features_missing((6, 3, 0)).is_empty());
        let old = features_missing((6, 2, 99));
        assert_eq!(old.len(), 1);
        assert!(old[0].contains("sock_send_length"));
        assert_eq!(features_missing((5, 10, 0)).len(), 2);
        assert_eq!(features_missing((4, 18, 0)).len(), 3);
        assert_eq!(features_missing((10, 0, 0)).len(), 0);
    }

    #[test]
    fn finds_tracefs_mounts() {
        let mounts = "sysfs /sys sysfs rw 0 0\n\
                      nodev /sys/kernel/tracing tracefs rw,relatime 0 0\n\
                      debugfs /sys/kernel/debug debugfs rw 0 0\n\
                      tracefs /sys/kernel/debug/tracing tracefs rw 0 0\n";
        assert_eq!(
            tracefs_mounts(mounts),
            vec![
                PathBuf::from("/sys/kernel/tracing"),
                PathBuf::from("/sys/kernel/debug/tracing")
            ]
        );
        assert!(tracefs_mounts("proc /proc proc rw 0 0\n").is_empty());
    }

    #[test]
    fn aggregates_verdicts() {
        let mut r = Report::default();
        assert_eq!(r.verdict(), Verdict::Ok);
        assert!(r.can_trace());
        r.items.push(Item::ok("kernel", "6.18"));
        r.items
            .push(Item::warn("nvml", "no library", "install the driver"));
        assert_eq!(r.verdict(), Verdict::Warn);
        assert!(r.can_trace());
        assert!(r.summary().starts_with("tracing can work"));
        r.items.push(Item::fail(
            "capabilities",
            "CAP_BPF missing",
            "grant CAP_BPF",
        ));
        assert_eq!(r.verdict(), Verdict::Fail);
        assert!(!r.can_trace());
        assert_eq!(
            r.summary(),
            "tracing cannot work here: 1 failed, 1 warning(s)"
        );
        let text = r.render();
        assert!(
            text.contains("FAIL  capabilities  CAP_BPF missing\n"),
            "{text}"
        );
        assert!(text.contains("fix: grant CAP_BPF\n"), "{text}");
        let json = r.to_json();
        assert_eq!(json["can_trace"], false);
        assert_eq!(json["items"][2]["verdict"], "fail");
        assert!(json["items"][0].get("fix").is_none());
    }
}
