//! Where a process runs: its cgroup path, and the container and Kubernetes
//! pod it belongs to, read from /proc without talking to any runtime or API
//! server (the daemon must work on a bare host, under Docker and on a node).

use std::fs;

/// The process's cgroup path: the v2 entry (`0::/path`), else the v1 `cpu`
/// or `memory` controller's, else the first line's.
pub fn cgroup_path(pid: u32) -> Option<String> {
    parse_cgroup(&fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?)
}

pub fn parse_cgroup(text: &str) -> Option<String> {
    let entries: Vec<(&str, &str)> = text
        .lines()
        .filter_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
            Some((controllers, path))
        })
        .collect();
    let pick = entries
        .iter()
        .find(|(c, _)| c.is_empty())
        .or_else(|| {
            entries
                .iter()
                .find(|(c, _)| c.split(',').any(|x| x == "cpu" || x == "memory"))
        })
        .or(entries.first())?;
    Some(pick.1.to_string())
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

/// A Kubernetes pod UID in a cgroup path (`pod<uid>` under `kubepods`;
/// the systemd driver writes the UID's dashes as underscores).
pub fn pod_uid(path: &str) -> Option<String> {
    if !path.contains("kubepods") {
        return None;
    }
    path.split('/').find_map(|component| {
        let rest = &component[component.rfind("pod")? + 3..];
        let uid: String = rest
            .chars()
            .take_while(|c| c.is_ascii_hexdigit() || *c == '-' || *c == '_')
            .map(|c| if c == '_' { '-' } else { c })
            .collect();
        (uid.len() == 36).then_some(uid)
    })
}

/// Pod name and namespace of a process in a Kubernetes pod: the downward
/// API variables `POD_NAME`/`POD_NAMESPACE` when the pod sets them, else the
/// files the kubelet puts in every container (`/etc/hostname` holds the pod
/// name; the service account mount holds the namespace), read through
/// `/proc/PID/root`. Missing pieces are empty.
pub fn pod_names(pid: u32) -> (String, String) {
    let environ = fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    let env = |key: &str| {
        environ
            .split(|&b| b == 0)
            .find_map(|kv| kv.strip_prefix(key.as_bytes())?.strip_prefix(b"="))
            .map(|v| String::from_utf8_lossy(v).into_owned())
    };
    let file = |path: &str| {
        fs::read_to_string(format!("/proc/{pid}/root{path}"))
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    };
    let pod = env("POD_NAME")
        .or_else(|| file("/etc/hostname"))
        .unwrap_or_default();
    let namespace = env("POD_NAMESPACE")
        .or_else(|| file("/var/run/secrets/kubernetes.io/serviceaccount/namespace"))
        .unwrap_or_default();
    (pod, namespace)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "4f1c3c2a9e8b7d6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f";

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
        let systemd = "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1b2c3d4e_5f60_7182_93a4_b5c6d7e8f901.slice/cri-containerd-x.scope";
        let cgroupfs = "/kubepods/besteffort/pod1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901/abc";
        assert_eq!(pod_uid(systemd).as_deref(), Some(uid));
        assert_eq!(pod_uid(cgroupfs).as_deref(), Some(uid));
        assert_eq!(pod_uid("/system.slice/pod-helper.service"), None);
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
        let mut names = pod_names(child.id());
        for _ in 0..100 {
            if names.0 == "vllm-7d9f" {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
            names = pod_names(child.id());
        }
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(names, ("vllm-7d9f".into(), "inference".into()));
    }
}
