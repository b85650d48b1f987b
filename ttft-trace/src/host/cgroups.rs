//! Where a process runs: its cgroup path, and the container and Kubernetes
//! pod it belongs to, read from /proc without talking to any runtime or API
//! server (the daemon must work on a bare host, under Docker and on a node).
//!
//! The cgroup path is the kernel's text, written by the kubelet and the
//! runtime: the container id and pod UID come from it, and the pod's names
//! from the host's records of that UID (`host::kubelet`). Everything else
//! here is the target's to write: the environment, and the files inside a
//! container. They are read through [`crate::host::rootfs`] (inside the
//! target's root, regular files only, capped), must look like a Kubernetes
//! name, and are only ever a claim ([`pod_claim`]), never a label.

use std::path::Path;

use crate::host::{
    kubelet,
    rootfs::{self, Root},
};

/// Most bytes read of `/proc/PID/cgroup` (a path is at most 4 KiB a
/// hierarchy; a v1 host lists about a dozen).
const CGROUP_FILE_MAX: u64 = 64 << 10;
/// Most bytes read of `/proc/PID/environ`: the kernel lets a process start
/// with a few MiB, the downward-API variables are among them.
const ENVIRON_MAX: u64 = 1 << 20;
/// Most bytes read of a file inside the container (`/etc/hostname`, the
/// namespace file): each holds one short name.
const NAME_FILE_MAX: u64 = 4 << 10;
/// Kubernetes limits: a pod name is a DNS-1123 subdomain, a namespace a
/// DNS-1123 label.
const POD_NAME_MAX: usize = 253;
const NAMESPACE_MAX: usize = 63;

/// The process's cgroup path: the v2 entry (`0::/path`), else the v1 `cpu`
/// or `memory` controller's, else the first line's.
pub fn cgroup_path(pid: u32) -> Option<String> {
    let text =
        rootfs::read_proc(Path::new(&format!("/proc/{pid}/cgroup")), CGROUP_FILE_MAX).ok()?;
    parse_cgroup(&String::from_utf8_lossy(&text))
}

pub fn parse_cgroup(text: &str) -> Option<String> {
    let entries = cgroup_entries(text);
    let pick = entries
        .iter()
        .find(|(_, c, _)| c.is_empty())
        .or_else(|| {
            entries
                .iter()
                .find(|(_, c, _)| c.split(',').any(|x| x == "cpu" || x == "memory"))
        })
        .or(entries.first())?;
    Some(pick.2.to_string())
}

/// The process's cgroup v2 path (`0::/path`) alone: None on a host
/// without the v2 hierarchy, or where it cannot be read.
pub fn cgroup_v2_path(pid: u32) -> Option<String> {
    let text =
        rootfs::read_proc(Path::new(&format!("/proc/{pid}/cgroup")), CGROUP_FILE_MAX).ok()?;
    parse_v2(&String::from_utf8_lossy(&text))
}

pub fn parse_v2(text: &str) -> Option<String> {
    cgroup_entries(text)
        .into_iter()
        .find(|(hierarchy, c, _)| *hierarchy == "0" && c.is_empty())
        .map(|(_, _, path)| path.to_string())
}

/// (hierarchy id, controllers, path) of each `/proc/PID/cgroup` line.
fn cgroup_entries(text: &str) -> Vec<(&str, &str, &str)> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.splitn(3, ':');
            Some((f.next()?, f.next()?, f.next()?))
        })
        .collect()
}

/// A container id in a cgroup path: the last 64-hex-digit run of a path
/// component (`docker-<id>.scope`, `cri-containerd-<id>.scope`,
/// `crio-<id>.scope`, `libpod-<id>.scope`, `/docker/<id>`,
/// `/kubepods/.../<id>`), shortened to 12 digits as `docker ps` shows it.
pub fn container_id(path: &str) -> Option<String> {
    path.rsplit('/').find_map(|component| {
        let bytes = component.as_bytes();
        (0..bytes.len().saturating_sub(63))
            .rev()
            .find(|&i| {
                let run = &bytes[i..i + 64];
                run.iter().all(u8::is_ascii_hexdigit)
                    && (i == 0 || !bytes[i - 1].is_ascii_hexdigit())
                    && bytes.get(i + 64).is_none_or(|b| !b.is_ascii_hexdigit())
            })
            .map(|i| component[i..i + 12].to_string())
    })
}

/// Where the kubelet puts a pod's cgroup, by QoS class: the cgroupfs
/// driver's directories above `pod<uid>` (guaranteed pods sit right under
/// `kubepods`).
const CGROUPFS_CHAINS: [&[&str]; 3] = [
    &["kubepods"],
    &["kubepods", "burstable"],
    &["kubepods", "besteffort"],
];

/// A Kubernetes pod UID in a cgroup path, where only the kubelet's naming
/// is accepted, whole: `/kubepods[/burstable|/besteffort]/pod<uid>/...`
/// (cgroupfs driver) or
/// `/kubepods.slice[/kubepods-<qos>.slice]/kubepods[-<qos>]-pod<uid_>.slice/...`
/// (systemd driver, the UID's dashes written as underscores), the UID a
/// lower-case RFC 4122 one. The first component named like a pod's is the
/// pod's, and every component above it must be the kubelet's own parent of
/// it: a `pod<uid>` a tenant makes in a cgroup delegated to it (below its
/// own pod, or under a service of the host) names no pod, or its own.
/// Read from inside a cgroup namespace (a daemon in a pod), the path starts
/// with `..` components and shows only the tail of that chain.
pub fn pod_uid(path: &str) -> Option<String> {
    let all: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
    let up = all.iter().take_while(|c| **c == "..").count();
    let comps = &all[up..];
    let (at, uid, chains) = comps
        .iter()
        .enumerate()
        .find_map(|(i, c)| pod_component(c).map(|(uid, chains)| (i, uid, chains)))?;
    let above = &comps[..at];
    let fits = |chain: &[&str]| {
        if up == 0 {
            chain == above
        } else {
            chain.ends_with(above)
        }
    };
    chains.iter().any(|c| fits(c)).then_some(uid)
}

/// The UID a cgroup directory name gives a pod, and the chains of parent
/// directories the kubelet would have put it under; None for a name that
/// is not a pod's.
fn pod_component(name: &str) -> Option<(String, &'static [&'static [&'static str]])> {
    if let Some(uid) = name.strip_prefix("pod") {
        return kubelet::is_uid(uid.as_bytes()).then(|| (uid.to_string(), &CGROUPFS_CHAINS[..]));
    }
    let stem = name.strip_suffix(".slice")?;
    let (parent, escaped) = stem.split_once("-pod")?;
    let chain: &'static [&'static [&'static str]] = match parent {
        "kubepods" => &[&["kubepods.slice"]],
        "kubepods-burstable" => &[&["kubepods.slice", "kubepods-burstable.slice"]],
        "kubepods-besteffort" => &[&["kubepods.slice", "kubepods-besteffort.slice"]],
        _ => return None,
    };
    // The systemd driver escapes every `-` of the UID as `_`.
    if escaped.contains('-') {
        return None;
    }
    let uid = escaped.replace('_', "-");
    kubelet::is_uid(uid.as_bytes()).then_some((uid, chain))
}

/// What a process in a Kubernetes pod says its pod is: the downward-API
/// variables `POD_NAME`/`POD_NAMESPACE` when it sets them, else the files
/// the kubelet puts in every container (`/etc/hostname` holds the pod name;
/// the service account mount holds the namespace), read inside the
/// process's root. The process writes all of these: they are a claim, to
/// check against the host's records (`host::kubelet`), never a label. A
/// value that is no Kubernetes name is dropped; a missing one is None.
pub fn pod_claim(pid: u32) -> (Option<String>, Option<String>) {
    let environ = rootfs::read_proc(Path::new(&format!("/proc/{pid}/environ")), ENVIRON_MAX)
        .unwrap_or_default();
    let env = |key: &str| {
        environ
            .split(|&b| b == 0)
            .find_map(|kv| kv.strip_prefix(key.as_bytes())?.strip_prefix(b"="))
    };
    let root = match Root::of_process(pid) {
        Ok(r) => Some(r),
        Err(e) => {
            log::debug!("{e}");
            None
        }
    };
    let file = |path: &str| match root.as_ref()?.read(Path::new(path), NAME_FILE_MAX) {
        Ok(bytes) => Some(bytes),
        Err(e) if e.is_not_found() => None,
        Err(e) => {
            log::warn!("process {pid}: not reading {path} for its claimed pod: {e}");
            None
        }
    };
    let name = |raw: Option<&[u8]>, max: usize, what: &str| {
        let raw = raw?;
        let name = kubernetes_name(raw, max);
        if name.is_none() {
            log::warn!("process {pid}: its {what} is no Kubernetes name; not taken as its claim");
        }
        name
    };
    let pod = name(env("POD_NAME"), POD_NAME_MAX, "POD_NAME").or_else(|| {
        name(
            file("/etc/hostname").as_deref(),
            POD_NAME_MAX,
            "/etc/hostname",
        )
    });
    let namespace = name(env("POD_NAMESPACE"), NAMESPACE_MAX, "POD_NAMESPACE").or_else(|| {
        let path = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";
        name(file(path).as_deref(), NAMESPACE_MAX, path)
    });
    (pod, namespace)
}

/// A Kubernetes object name read from a target (a file or its
/// environment): the first line, surrounding whitespace trimmed, when it is
/// a DNS-1123 name of at most `max` characters (lower-case letters, digits,
/// `-` and `.`, starting and ending with a letter or digit); None
/// otherwise, so that nothing else a container writes reaches a claim.
pub fn kubernetes_name(raw: &[u8], max: usize) -> Option<String> {
    let line = raw.split(|&b| b == b'\n').next().unwrap_or_default();
    let name = line.trim_ascii();
    let inner_ok =
        |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-' || *b == b'.';
    let end_ok = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let ok = !name.is_empty()
        && name.len() <= max
        && name.iter().all(inner_ok)
        && name.first().is_some_and(end_ok)
        && name.last().is_some_and(end_ok);
    // Only ASCII bytes passed: the conversion cannot fail.
    ok.then(|| String::from_utf8_lossy(name).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_kubernetes_names_become_labels() {
        assert_eq!(
            kubernetes_name(b"vllm-0.serving\n", 253).as_deref(),
            Some("vllm-0.serving")
        );
        assert_eq!(
            kubernetes_name(b"  inference \r\n", 63).as_deref(),
            Some("inference")
        );
        for bad in [
            &b""[..],
            b"\n",
            b"root:x:0:0:root:/root:/bin/bash",
            b"Serving",
            b"-lead",
            b"trail-",
            b"\x00\x00\x00",
            b"caf\xc3\xa9",
            b"a\"} 1\nfake_metric 2",
        ] {
            assert_eq!(kubernetes_name(bad, 253), None, "{bad:?}");
        }
        let long = [b'a'; 64];
        assert_eq!(kubernetes_name(&long, 63), None);
        assert_eq!(kubernetes_name(&long[..63], 63).map(|s| s.len()), Some(63));
        // Only the first line counts.
        assert_eq!(kubernetes_name(b"ns\nsecret", 63).as_deref(), Some("ns"));
    }

    const ID: &str = "4f1c3c2a9e8b7d6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f";

    #[test]
    fn reads_the_v2_entry_alone() {
        let hybrid = "12:cpu,cpuacct:/docker/abc\n0::/system.slice/vllm.service\n";
        assert_eq!(
            parse_v2(hybrid).as_deref(),
            Some("/system.slice/vllm.service")
        );
        assert_eq!(parse_v2("12:cpu,cpuacct:/docker/abc\n"), None);
        assert_eq!(parse_v2("0::/\n").as_deref(), Some("/"));
    }

    #[test]
    fn picks_the_v2_entry_then_cpu() {
        assert_eq!(
            parse_cgroup("0::/system.slice/vllm.service\n").as_deref(),
            Some("/system.slice/vllm.service")
        );
        let v1 = "12:pids:/a\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/b\n";
        assert_eq!(parse_cgroup(v1).as_deref(), Some("/docker/abc"));
        assert_eq!(parse_cgroup(""), None);
    }

    #[test]
    fn finds_container_ids_of_each_runtime() {
        for path in [
            format!("/system.slice/docker-{ID}.scope"),
            format!("/docker/{ID}"),
            format!(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2c3d4e_5f60_7182_93a4_b5c6d7e8f901.slice/cri-containerd-{ID}.scope"
            ),
            format!("/kubepods/burstable/pod1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901/{ID}"),
            format!("/machine.slice/libpod-{ID}.scope/container"),
        ] {
            assert_eq!(container_id(&path).as_deref(), Some(&ID[..12]), "{path}");
        }
        assert_eq!(
            container_id("/user.slice/user-0.slice/session-3.scope"),
            None
        );
        // 65 hex digits is not an id.
        assert_eq!(container_id(&format!("/x/{ID}a")), None);
    }

    #[test]
    fn finds_pod_uids_with_either_driver() {
        let uid = "1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901";
        let u = "1b2c3d4e_5f60_7182_93a4_b5c6d7e8f901";
        for path in [
            format!(
                "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice/cri-containerd-x.scope"
            ),
            format!("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice"),
            format!("/kubepods.slice/kubepods-pod{u}.slice/crio-x.scope"),
            format!("/kubepods/besteffort/pod{uid}/abc"),
            format!("/kubepods/burstable/pod{uid}"),
            format!("/kubepods/pod{uid}/abc"),
            // Seen from a daemon in a pod (its own cgroup namespace).
            format!("/../../kubepods-besteffort-pod{u}.slice/cri-containerd-x.scope"),
            format!("/../../kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice/x"),
            format!("/../../../kubepods/besteffort/pod{uid}/abc"),
            format!("/../../pod{uid}/abc"),
            // A tenant's own sub-cgroups below its pod do not change its UID.
            format!("/kubepods/pod{uid}/abc/kubepods/pod0a1b2c3d-4e5f-4061-8273-94a5b6c7d8e9"),
        ] {
            assert_eq!(pod_uid(&path).as_deref(), Some(uid), "{path}");
        }
    }

    #[test]
    fn no_partial_or_forged_pod_uids() {
        let uid = "1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901";
        let u = "1b2c3d4e_5f60_7182_93a4_b5c6d7e8f901";
        for path in [
            "/system.slice/pod-helper.service".to_string(),
            // Not the kubelet's parents.
            format!("/system.slice/x.service/kubepods/pod{uid}"),
            format!("/user.slice/kubepods.slice/kubepods-pod{u}.slice"),
            format!("/../../system.slice/x.service/kubepods-pod{u}.slice"),
            format!("/kubepods/guaranteed/pod{uid}/abc"),
            format!("/kubepods/burstable/besteffort/pod{uid}"),
            format!("/kubepods.slice/kubepods-besteffort.slice/kubepods-burstable-pod{u}.slice"),
            format!("/kubepods.slice/kubepods-besteffort-pod{u}.slice"),
            format!("/kubepods-besteffort-pod{u}.slice"),
            format!("/pod{uid}"),
            format!("/burstable/pod{uid}"),
            // The driver's separator, whole: no mix, no swap.
            format!("/kubepods.slice/kubepods-pod{uid}.slice"),
            format!("/kubepods/pod{u}"),
            format!(
                "/kubepods.slice/kubepods-pod{}.slice",
                u.replacen('_', "-", 1)
            ),
            // Partial, padded or upper-case UIDs.
            format!("/kubepods/pod{uid}0"),
            format!("/kubepods/pod{}", &uid[..35]),
            format!("/kubepods/pod{}", uid.to_uppercase()),
            format!("/kubepods/xpod{uid}"),
            format!("/kubepods/pod{uid}.scope"),
            "/kubepods/pod0123456789abcdef0123456789abcdef".to_string(),
            format!("/kubepods.slice/kubepods-pod{u}.slicex"),
            format!("/kubepods.slice/kubepods-x-pod{u}.slice"),
        ] {
            assert_eq!(pod_uid(&path), None, "{path}");
        }
    }

    #[test]
    fn reads_a_live_process() {
        assert!(cgroup_path(std::process::id()).is_some());
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .env("POD_NAME", "vllm-7d9f")
            .env("POD_NAMESPACE", "inference")
            .spawn()
            .expect("spawn sleep");
        // Right after spawn the new image's environment may not be readable yet.
        let mut names = pod_claim(child.id());
        for _ in 0..100 {
            if names.0.as_deref() == Some("vllm-7d9f") {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
            names = pod_claim(child.id());
        }
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(names, (Some("vllm-7d9f".into()), Some("inference".into())));
    }
}
