"""Offline validation of deploy/ files against real schemas (no cluster, no Grafana).

Run with the validators' venv that `cargo xtask setup` makes in the cache:

    python validate.py servicemonitor FILE...   # prometheus-operator CRD models
    python validate.py grafana FILE...          # Grafana's schema (foundation SDK)
    python validate.py hardening FILE...        # DaemonSet / systemd unit confinement

Both decode the document with models generated from the real schema (the
prometheus-operator CRDs' openAPIV3Schema, Grafana's dashboard and panel
kinds), which check types, enums and patterns, then encode it again: any key
of the file that the round trip loses is one the schema does not know (a typo
or a field of another version), and is an error. Core Kubernetes objects are
checked with `kubernetes-validate --strict` instead. Exit 1 on any error.
"""

import json
import sys

import yaml


def lost_keys(src, out, path=""):
    """Paths of `src` missing from its round trip `out` (and changed values)."""
    errors = []
    if isinstance(src, dict):
        if not isinstance(out, dict):
            return [f"{path or '.'}: became {type(out).__name__}"]
        for key, value in src.items():
            here = f"{path}.{key}"
            if key not in out:
                errors.append(f"{here}: not in the schema")
            else:
                errors += lost_keys(value, out[key], here)
    elif isinstance(src, list):
        if not isinstance(out, list) or len(src) != len(out):
            return [f"{path}: list changed in the round trip"]
        for i, (a, b) in enumerate(zip(src, out)):
            errors += lost_keys(a, b, f"{path}[{i}]")
    elif src != out:
        errors.append(f"{path}: {src!r} became {out!r}")
    return errors


def servicemonitor(path):
    from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

    errors = []
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    for doc in docs:
        if doc.get("kind") != "ServiceMonitor":
            errors.append(f"{path}: a {doc.get('kind')}, not a ServiceMonitor")
            continue
        try:
            model = ServiceMonitor.model_validate(doc)
        except Exception as e:  # pydantic's ValidationError lists every field
            errors.append(f"{path}: {e}")
            continue
        out = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
        errors += [f"{path}: {e}" for e in lost_keys(doc, out)]
    if not docs:
        errors.append(f"{path}: no document")
    return errors, f"{len(docs)} ServiceMonitor(s)"


def grafana(path):
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models import prometheus
    from grafana_foundation_sdk.models.dashboard import Dashboard, Panel, RowPanel

    register_default_plugins()
    with open(path) as f:
        src = json.load(f)
    dash = Dashboard.from_json(src)
    out = json.loads(json.dumps(dash, cls=JSONEncoder))
    errors = [f"{path}: {e}" for e in lost_keys(src, out)]
    panels = targets = 0
    for p in dash.panels or []:
        if isinstance(p, RowPanel):
            continue
        panels += 1
        where = f"{path}: panel {p.title!r}"
        if not isinstance(p, Panel):
            errors.append(f"{where}: not a panel")
            continue
        # Options decoded by the panel plugin's own model, not left a dict.
        if isinstance(p.options, dict):
            errors.append(f"{where}: options of unknown panel type {p.type!r}")
        for t in p.targets or []:
            targets += 1
            if not isinstance(t, prometheus.Dataquery):
                errors.append(f"{where}: target {t!r} is not a Prometheus query")
            elif not t.expr:
                errors.append(f"{where}: target {t.ref_id} has no expr")
    return errors, f"{panels} panels, {targets} Prometheus targets"


# The capabilities the daemon needs (docs/deployment.md): nothing else may be
# added, and these must be.
CAPS_ALLOWED = {"SYS_ADMIN", "BPF", "PERFMON", "SYS_PTRACE", "DAC_READ_SEARCH"}
CAPS_NEEDED = {"SYS_ADMIN", "SYS_PTRACE", "DAC_READ_SEARCH"}


# Host directories the daemon only reads, which must be mounted read-only:
# the kubelet's pod log directory (the pods' names) must be mounted at all.
HOST_READ_ONLY = {"/var/log/pods"}
HOST_NEEDED = {"/var/log/pods"}


def host_mounts(pod, c, where):
    """Errors of container `c`'s mounts of the host directories in
    HOST_READ_ONLY: each read-only, and those of HOST_NEEDED present."""
    errors = []
    host_paths = {
        v["name"]: v["hostPath"]["path"].rstrip("/")
        for v in pod.get("volumes", [])
        if v.get("hostPath")
    }
    mounted = set()
    for m in c.get("volumeMounts", []):
        host = host_paths.get(m.get("name"))
        if host not in HOST_READ_ONLY:
            continue
        mounted.add(host)
        if m.get("readOnly") is not True:
            errors.append(f"{where}: the host's {host} is mounted read-write")
    for host in sorted(HOST_NEEDED - mounted):
        errors.append(f"{where}: the host's {host} is not mounted")
    return errors


def daemonset_hardening(path):
    """The DaemonSet's containers: all capabilities dropped and only the
    needed ones added, the runtime's (or our own) seccomp profile, a
    read-only root, not privileged, the host's pod log directory mounted
    read-only."""
    errors = []
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d and d.get("kind") == "DaemonSet"]
    for ds in docs:
        pod = ds["spec"]["template"]["spec"]
        pod_seccomp = (pod.get("securityContext") or {}).get("seccompProfile") or {}
        for c in pod.get("containers", []):
            where = f"{path}: container {c.get('name')}"
            sc = c.get("securityContext") or {}
            caps = sc.get("capabilities") or {}
            if caps.get("drop") != ["ALL"]:
                errors.append(f"{where}: capabilities.drop is {caps.get('drop')!r}, not [ALL]")
            added = set(caps.get("add") or [])
            if added - CAPS_ALLOWED:
                errors.append(f"{where}: adds {sorted(added - CAPS_ALLOWED)} it does not need")
            if CAPS_NEEDED - added:
                errors.append(f"{where}: lacks {sorted(CAPS_NEEDED - added)}")
            seccomp = sc.get("seccompProfile") or pod_seccomp
            if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
                errors.append(f"{where}: seccomp {seccomp.get('type')!r}, not RuntimeDefault")
            if sc.get("readOnlyRootFilesystem") is not True:
                errors.append(f"{where}: root filesystem not read-only")
            if sc.get("privileged") is not False:
                errors.append(f"{where}: privileged not set to false")
            errors += host_mounts(pod, c, where)
    if not docs:
        errors.append(f"{path}: no DaemonSet")
    return errors, f"{len(docs)} DaemonSet(s) confined"


# systemd directives the unit must keep, with their value.
UNIT_REQUIRED = {
    "NoNewPrivileges": "yes",
    "DynamicUser": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "read-only",
    "PrivateTmp": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectControlGroups": "yes",
    "RestrictNamespaces": "net",
    "RestrictSUIDSGID": "yes",
    "MemoryDenyWriteExecute": "yes",
    "UMask": "0027",
}
UNIT_FAMILIES = {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}


def unit_hardening(path):
    """The systemd unit: its sandboxing directives, and capabilities no
    wider than the daemon needs."""
    settings = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if "=" in line and not line.startswith(("#", ";")):
                key, value = line.split("=", 1)
                settings[key] = value
    errors = [
        f"{path}: {k}={settings.get(k)!r}, not {v}"
        for k, v in UNIT_REQUIRED.items()
        if settings.get(k) != v
    ]
    bounding = set(settings.get("CapabilityBoundingSet", "").split())
    wide = {c for c in bounding if c.removeprefix("CAP_") not in CAPS_ALLOWED}
    if wide or not bounding:
        errors.append(f"{path}: CapabilityBoundingSet holds {sorted(wide) or 'nothing'}")
    if set(settings.get("AmbientCapabilities", "").split()) - bounding:
        errors.append(f"{path}: AmbientCapabilities outside the bounding set")
    families = set(settings.get("RestrictAddressFamilies", "").split())
    if not families or families - UNIT_FAMILIES:
        errors.append(f"{path}: RestrictAddressFamilies {sorted(families)}")
    for bound in ("LimitNOFILE", "MemoryMax"):
        if bound not in settings:
            errors.append(f"{path}: no {bound}")
    return errors, f"{len(settings)} settings"


def hardening(path):
    return unit_hardening(path) if path.endswith(".service") else daemonset_hardening(path)


CHECKS = {"servicemonitor": servicemonitor, "grafana": grafana, "hardening": hardening}


def main():
    if len(sys.argv) < 3 or sys.argv[1] not in CHECKS:
        print(__doc__)
        return 2
    check = CHECKS[sys.argv[1]]
    failed = False
    for path in sys.argv[2:]:
        errors, what = check(path)
        for e in errors:
            print(f"ERROR {e}")
        failed |= bool(errors)
        print(f"{'FAIL' if errors else 'OK'} {path}: {what}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
