//! No service of a package set-up installed is left enabled at boot or
//! running: the tests and the bench start their own nginx and Prometheus on
//! loopback. Set-up's installs are found in apt's history by their command
//! line (`apt-get install -y -q --no-install-recommends` of packages set-up
//! installs), with the dependencies each pulled in; the services are what
//! those packages ship (dpkg's file lists). A package the machine had before
//! set-up ran is left as it is.
//!
//! Disabling works without a running systemd (`systemctl disable` edits the
//! `*.wants` links offline, and syncs the SysV links through update-rc.d);
//! stopping needs one.

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use super::step::Log;

const HISTORY: &str = "/var/log/apt/history.log";
const DPKG_INFO: &str = "/var/lib/dpkg/info";
const SYSTEMD_ETC: &str = "/etc/systemd/system";
const SETUP_COMMAND: &str = "apt-get install -y -q --no-install-recommends ";

/// Stops and disables the services of the packages set-up installed (of
/// `ours`, with their dependencies); says what it did (nothing when all is
/// well, without running a command).
pub fn settle(log: &mut Log, ours: &[&str]) -> Result<Vec<String>> {
    let history = fs::read_to_string(HISTORY).unwrap_or_default();
    let packages = setup_installs(&history, ours);
    let mut units = BTreeSet::new();
    let mut scripts = BTreeSet::new();
    for list in dpkg_lists(&packages)? {
        let shipped = shipped_services(&fs::read_to_string(&list)?);
        units.extend(shipped.units);
        scripts.extend(shipped.init_scripts);
    }
    let mut done = Vec::new();
    if Path::new("/run/systemd/system").is_dir() {
        for unit in &units {
            let active = Command::new("systemctl")
                .args(["is-active", "--quiet", unit])
                .status()
                .is_ok_and(|s| s.success());
            if active {
                log.run(Command::new("systemctl").args(["stop", unit]))?;
                done.push(format!("{unit} stopped"));
            }
        }
    }
    for unit in units.iter().filter(|u| !wants_links(u).is_empty()) {
        if Path::new("/usr/bin/systemctl").exists() || Path::new("/bin/systemctl").exists() {
            log.run(Command::new("systemctl").args(["disable", unit]))?;
        }
        for link in wants_links(unit) {
            fs::remove_file(&link).with_context(|| format!("removing {}", link.display()))?;
        }
        done.push(format!("{unit} disabled at boot"));
    }
    for script in scripts.iter().filter(|s| !rc_start_links(s).is_empty()) {
        log.run(Command::new("update-rc.d").args([script, "disable"]))?;
        if !rc_start_links(script).is_empty() {
            bail!("/etc/init.d/{script} still starts at boot after update-rc.d disable");
        }
        done.push(format!("/etc/init.d/{script} disabled at boot"));
    }
    Ok(done)
}

/// The packages set-up's own installs brought in: the entries of apt's
/// history whose command line is set-up's, for packages of `ours` only,
/// and what each installed (dependencies too).
fn setup_installs(history: &str, ours: &[&str]) -> Vec<String> {
    let mut installed = BTreeSet::new();
    for entry in history.split("\n\n") {
        let ours_only = entry
            .lines()
            .find_map(|l| l.strip_prefix("Commandline: "))
            .and_then(|c| c.strip_prefix(SETUP_COMMAND))
            .is_some_and(|names| names.split_whitespace().all(|n| ours.contains(&n)));
        if !ours_only {
            continue;
        }
        if let Some(list) = entry.lines().find_map(|l| l.strip_prefix("Install: ")) {
            installed.extend(package_names(list));
        }
    }
    installed.into_iter().collect()
}

/// The names in an `Install:` line: `name:arch (version[, automatic]), ...`.
fn package_names(list: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut depth = 0;
    let mut current = String::new();
    for c in list.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => names.push(std::mem::take(&mut current)),
            _ if depth == 0 => current.push(c),
            _ => {}
        }
    }
    names.push(current);
    names
        .iter()
        .filter_map(|n| n.trim().split(':').next())
        .filter(|n| !n.is_empty())
        .map(str::to_string)
        .collect()
}

/// dpkg's file list of each package (`NAME.list`, or `NAME:ARCH.list` for
/// a multi-arch one).
fn dpkg_lists(packages: &[String]) -> Result<Vec<PathBuf>> {
    if packages.is_empty() {
        return Ok(Vec::new());
    }
    let mut lists = Vec::new();
    for entry in fs::read_dir(DPKG_INFO).with_context(|| format!("reading {DPKG_INFO}"))? {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let package = name
            .strip_suffix(".list")
            .map(|n| n.split(':').next().unwrap_or(n));
        if package.is_some_and(|p| packages.iter().any(|q| q == p)) {
            lists.push(path);
        }
    }
    Ok(lists)
}

/// The systemd units (templates aside) and SysV init scripts in a package's
/// file list.
#[derive(Debug, Default, PartialEq, Eq)]
struct Shipped {
    units: Vec<String>,
    init_scripts: Vec<String>,
}

fn shipped_services(list: &str) -> Shipped {
    let mut shipped = Shipped::default();
    for path in list.lines() {
        let unit = path
            .strip_prefix("/lib/systemd/system/")
            .or_else(|| path.strip_prefix("/usr/lib/systemd/system/"));
        if let Some(unit) = unit
            && !unit.contains('/')
            && !unit.contains('@')
            && [".service", ".socket", ".timer", ".path"]
                .iter()
                .any(|kind| unit.ends_with(kind))
        {
            shipped.units.push(unit.to_string());
        }
        if let Some(script) = path.strip_prefix("/etc/init.d/")
            && !script.is_empty()
            && !script.contains('/')
        {
            shipped.init_scripts.push(script.to_string());
        }
    }
    shipped
}

/// The links that start `unit` at boot: `/etc/systemd/system/*.wants/UNIT`
/// (and `*.requires`).
fn wants_links(unit: &str) -> Vec<PathBuf> {
    let Ok(dirs) = fs::read_dir(SYSTEMD_ETC) else {
        return Vec::new();
    };
    dirs.filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|d| {
            d.extension()
                .is_some_and(|x| x == "wants" || x == "requires")
        })
        .map(|d| d.join(unit))
        .filter(|l| l.symlink_metadata().is_ok())
        .collect()
}

/// The SysV links that start `script` at boot: `/etc/rc?.d/S<NN><script>`.
fn rc_start_links(script: &str) -> Vec<PathBuf> {
    let mut links = Vec::new();
    for level in ["0", "1", "2", "3", "4", "5", "6", "S"] {
        let dir = PathBuf::from(format!("/etc/rc{level}.d"));
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.filter_map(|e| e.ok()) {
            let name = entry.file_name();
            if name.to_str().is_some_and(|n| starts(n, script)) {
                links.push(entry.path());
            }
        }
    }
    links
}

/// Whether an rc link's name starts `script`: `S`, two digits, the name.
fn starts(link: &str, script: &str) -> bool {
    link.strip_prefix('S').is_some_and(|rest| {
        rest.len() == script.len() + 2
            && rest[..2].bytes().all(|b| b.is_ascii_digit())
            && &rest[2..] == script
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PACKAGES: &[&str] = &["prometheus", "nginx-light", "libmicrohttpd-dev", "bpftool"];

    /// Entries of this machine's /var/log/apt/history.log.
    const HISTORY_SAMPLE: &str = "\
Start-Date: 2026-05-20  10:00:00
Commandline: apt-get install -y -q --no-install-recommends postgresql
Install: postgresql:amd64 (15), postgresql-15:amd64 (15.8-0+deb12u1, automatic)
End-Date: 2026-05-20  10:00:09

Start-Date: 2026-12-04  18:51:41
Commandline: apt-get install -y -q --no-install-recommends prometheus
Install: libjs-d3:amd64 (3.5.17-4, automatic), prometheus:amd64 (2.42.0+ds-5+b6)
End-Date: 2026-12-04  18:51:49

Start-Date: 2026-12-04  18:52:26
Commandline: apt-get install -y -q --no-install-recommends nginx-light libmicrohttpd-dev
Install: libmicrohttpd12:amd64 (0.9.75-6, automatic), nginx-common:amd64 (1.22.1-9+deb12u7, automatic), nginx-light:amd64 (1.22.1-9+deb12u7)
End-Date: 2026-12-04  18:52:28

Start-Date: 2026-12-04  18:52:35
Commandline: apt-get install -y -q --no-install-recommends bpftool
Install: bpftool:amd64 (7.1.0+6.1.192-3)
Upgrade: linux-perf:amd64 (6.1.187-1, 6.1.192-3)
End-Date: 2026-12-04  18:52:43

Start-Date: 2026-12-04  18:53:00
Commandline: apt-get install -y nginx-light
Install: nginx-light:amd64 (1.22.1-9+deb12u7)
End-Date: 2026-12-04  18:53:01
";

    #[test]
    fn setup_installs_are_its_command_line_for_its_packages_with_their_dependencies() {
        assert_eq!(
            setup_installs(HISTORY_SAMPLE, PACKAGES),
            [
                "bpftool",
                "libjs-d3",
                "libmicrohttpd12",
                "nginx-common",
                "nginx-light",
                "prometheus"
            ]
        );
    }

    #[test]
    fn install_lines_name_packages_without_arch_or_version() {
        assert_eq!(
            package_names("a:amd64 (1, automatic), b (2:1.0-1)"),
            ["a", "b"]
        );
    }

    #[test]
    fn a_packages_services_are_its_units_and_init_scripts() {
        let list = "/.\n/etc/init.d/nginx\n/lib/systemd/system/nginx.service\n\
                    /lib/systemd/system/getty@.service\n/usr/lib/systemd/system/x.timer\n\
                    /lib/systemd/system/nginx.service.d/override.conf\n/usr/sbin/nginx\n";
        assert_eq!(
            shipped_services(list),
            Shipped {
                units: vec!["nginx.service".into(), "x.timer".into()],
                init_scripts: vec!["nginx".into()],
            }
        );
    }

    #[test]
    fn an_rc_start_link_is_s_two_digits_and_the_script() {
        assert!(starts("S01nginx", "nginx"));
        assert!(!starts("K01nginx", "nginx"));
        assert!(!starts("S01nginx-debug", "nginx"));
        assert!(!starts("S1nginx", "nginx"));
    }
}
