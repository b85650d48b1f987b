//! The Debian packages the tests and the bench run (as root), installed with
//! apt-get when missing, with no service started by the install, and no
//! service of theirs left enabled at boot (see `services`).

use std::{fs, path::Path, process::Command};

use anyhow::{Context as _, Result};

use super::{
    services,
    step::{Log, Outcome, Step},
};

/// Every package these steps install: the only ones whose services
/// `services` stops and disables.
pub const PACKAGES: &[&str] = &[
    "nftables",
    "prometheus",
    "nginx-light",
    "libmicrohttpd-dev",
    "libssl-dev",
    "systemd",
    "bpftool",
    "bpftrace",
    "chromium",
];

pub const NFTABLES: Step = Step {
    what: "nftables (nft: the packet-loss tests)",
    log: "nftables",
    run: |log| tool(log, "nft", &["nftables"]),
};

/// Debian's `prometheus` (the server and `promtool`), for the tests that run
/// a real Prometheus against the tracer and check deploy/prometheus/. The
/// tests start their own server on loopback.
pub const PROMETHEUS: Step = Step {
    what: "prometheus and promtool (the live Prometheus and deploy/ tests)",
    log: "prometheus",
    run: |log| {
        install_unless(
            log,
            on_path("prometheus") && on_path("promtool"),
            &["prometheus"],
        )
    },
};

/// nginx (the reverse proxy) and libmicrohttpd (the C server library) of
/// the real-stacks test (tests/tests/stacks.rs), which starts its own nginx
/// on loopback and builds its libmicrohttpd server itself; OpenSSL's static
/// libraries, linked into the TLS test's own server (tests/tests/tls.rs).
pub const HTTP_STACK_PACKAGES: Step = Step {
    what: "nginx-light, libmicrohttpd-dev and libssl-dev (the real-stacks and TLS tests)",
    log: "nginx-microhttpd",
    run: |log| {
        let present = Path::new("/usr/sbin/nginx").is_file()
            && Path::new("/usr/include/microhttpd.h").is_file()
            && Path::new("/usr/include/openssl/ssl.h").is_file();
        install_unless(
            log,
            present,
            &["nginx-light", "libmicrohttpd-dev", "libssl-dev"],
        )
    },
};

pub const SYSTEMD_ANALYZE: Step = Step {
    what: "systemd-analyze (verifies the systemd unit)",
    log: "systemd-analyze",
    run: |log| tool(log, "systemd-analyze", &["systemd"]),
};

pub const BPFTOOL: Step = Step {
    what: "bpftool (the tracer's links and maps, per-program costs)",
    log: "bpftool",
    run: |log| tool(log, "bpftool", &["bpftool"]),
};

pub const BPFTRACE: Step = Step {
    what: "bpftrace (the cost bench's floor)",
    log: "bpftrace",
    run: |log| tool(log, "bpftrace", &["bpftrace"]),
};

/// Debian's chromium, for the test that renders `ttft-trace report --html`
/// in a real headless browser (tests/tests/report.rs).
pub const CHROMIUM: Step = Step {
    what: "chromium (renders the HTML report headless)",
    log: "chromium",
    run: |log| tool(log, "chromium", &["chromium"]),
};

/// Runs last: whatever the install steps did, and on a machine where an
/// earlier set-up left a service enabled.
pub const SERVICES: Step = Step {
    what: "services of set-up's packages (none enabled at boot, none running)",
    log: "services",
    run: |log| {
        if !is_root() {
            return Ok(Outcome::Skipped("not root".into()));
        }
        let done = services::settle(log, PACKAGES)?;
        Ok(if done.is_empty() {
            Outcome::Found("none enabled or running")
        } else {
            Outcome::Changed(done.join(", "))
        })
    },
};

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Installs `packages` when `tool` is missing.
fn tool(log: &mut Log, tool: &str, packages: &[&str]) -> Result<Outcome> {
    let present = on_path(tool)
        || Path::new("/usr/sbin").join(tool).is_file()
        || Path::new("/usr/bin").join(tool).is_file();
    install_unless(log, present, packages)
}

fn on_path(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Installs `packages` unless `present`; not root: says so and leaves it
/// (what needs them runs as root).
fn install_unless(log: &mut Log, present: bool, packages: &[&str]) -> Result<Outcome> {
    if present {
        return Ok(Outcome::Found("present"));
    }
    if !is_root() {
        return Ok(Outcome::Skipped(
            "missing; not root, so not installed (what uses it runs as root)".into(),
        ));
    }
    install(log, packages)?;
    let settled = services::settle(log, PACKAGES)?;
    Ok(Outcome::Changed(if settled.is_empty() {
        "installed".into()
    } else {
        format!("installed; {}", settled.join(", "))
    }))
}

const POLICY: &str = "/usr/sbin/policy-rc.d";
const SAVED_POLICY: &str = "/usr/sbin/policy-rc.d.ttft-trace-saved";

/// `apt-get install` of `packages`, with an `apt-get update` first only if
/// the plain install fails (a fresh image's lists may be stale), while a
/// policy-rc.d forbids every service start (invoke-rc.d and
/// deb-systemd-invoke ask it). One the machine has that already forbids
/// them is left; one that allows them is put back afterwards.
///
/// The command line stays `apt-get install -y -q --no-install-recommends
/// PACKAGES`: `services` recognises set-up's installs by it in apt's history.
fn install(log: &mut Log, packages: &[&str]) -> Result<()> {
    let swapped = forbid_service_starts(log)?;
    let mut apt_get = |args: &[&str]| {
        log.run(
            Command::new("apt-get")
                .args(args)
                .env("DEBIAN_FRONTEND", "noninteractive"),
        )
    };
    let install: Vec<&str> = ["install", "-y", "-q", "--no-install-recommends"]
        .into_iter()
        .chain(packages.iter().copied())
        .collect();
    let result = apt_get(&install).or_else(|_| {
        apt_get(&["update", "-q"])?;
        apt_get(&install)
    });
    let restored = restore_policy(swapped);
    result.and(restored)
}

/// Puts a policy-rc.d that forbids service starts in place, unless the one
/// there does already (exit 101 for a start); says whether one was put.
fn forbid_service_starts(log: &mut Log) -> Result<bool> {
    let policy = Path::new(POLICY);
    if policy.exists() {
        let forbids = Command::new(policy)
            .args(["ttft-trace-setup-check", "start"])
            .status()
            .is_ok_and(|s| s.code() == Some(101));
        if forbids {
            log.note(&format!("{POLICY} already forbids service starts"))?;
            return Ok(false);
        }
        fs::rename(policy, SAVED_POLICY).with_context(|| format!("setting {POLICY} aside"))?;
    }
    fs::write(
        policy,
        "#!/bin/sh\n# ttft-trace setup: no service starts during its install\nexit 101\n",
    )?;
    fs::set_permissions(policy, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    log.note(&format!(
        "{POLICY}: service starts forbidden during the install"
    ))?;
    Ok(true)
}

/// Removes the policy-rc.d set-up put, and puts back the machine's own.
fn restore_policy(swapped: bool) -> Result<()> {
    if !swapped {
        return Ok(());
    }
    fs::remove_file(POLICY).with_context(|| format!("removing {POLICY}"))?;
    if Path::new(SAVED_POLICY).exists() {
        fs::rename(SAVED_POLICY, POLICY).with_context(|| format!("restoring {POLICY}"))?;
    }
    Ok(())
}
