"""Offline validation of deploy/ files against real schemas (no cluster, no Grafana).

Run with the validators' venv that `cargo xtask setup` makes in the cache:

    python validate.py servicemonitor FILE...   # prometheus-operator CRD models
    python validate.py grafana FILE...          # Grafana's schema (foundation SDK)

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


def main():
    if len(sys.argv) < 3 or sys.argv[1] not in ("servicemonitor", "grafana"):
        print(__doc__)
        return 2
    check = servicemonitor if sys.argv[1] == "servicemonitor" else grafana
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
