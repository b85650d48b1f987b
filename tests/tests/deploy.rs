//! The deployment files of deploy/, checked offline (no root, no cluster, no
//! Grafana): promtool on the Prometheus rules and their unit tests, the
//! Kubernetes objects against Kubernetes' OpenAPI schemas and the
//! prometheus-operator CRD models, the Grafana dashboard against Grafana's
//! schema models and for what its panels must show. The tools come from
//! `cargo xtask setup`; a missing one skips with the reason (fails with
//! `TTFT_TRACE_REQUIRE_FIXTURES`). tests/tests/prometheus.rs evaluates the
//! same rules and panels on a live Prometheus.

use std::{fs, process::Command};

use anyhow::{Context as _, Result, ensure};
use serde_json::{Value, json};
use ttft_trace_tests::prometheus::{
    dashboard, dashboard_queries, deploy_dir, require_tool, run_ok, validators_python,
};

#[test]
fn prometheus_rules_pass_promtool_check_and_their_unit_tests() -> Result<()> {
    let test = "prometheus_rules_pass_promtool_check_and_their_unit_tests";
    let Some(promtool) = require_tool("promtool", test) else {
        return Ok(());
    };
    let dir = deploy_dir().join("prometheus");
    let out = run_ok(
        Command::new(&promtool)
            .args(["check", "rules", "rules.yml"])
            .current_dir(&dir),
    )?;
    eprintln!("{out}");
    ensure!(out.contains("SUCCESS"), "{out}");
    let out = run_ok(
        Command::new(&promtool)
            .args(["test", "rules", "rules_test.yml"])
            .current_dir(&dir),
    )?;
    eprintln!("{out}");
    ensure!(out.contains("SUCCESS"), "{out}");
    // The unit tests are not vacuous: each alert is expected to fire on a
    // bad series and expected quiet on the good one.
    let tests = fs::read_to_string(dir.join("rules_test.yml"))?;
    for alert in ["TTFTErrorBudgetBurnFast", "TTFTErrorBudgetBurnSlow"] {
        ensure!(
            tests.contains(&format!(
                "alertname: {alert}\n        exp_alerts:\n          - "
            )),
            "{alert} never expected to fire"
        );
        ensure!(
            tests.contains(&format!("alertname: {alert}\n        exp_alerts: []")),
            "{alert} never expected quiet"
        );
    }
    Ok(())
}

#[test]
fn rules_and_panels_aggregate_buckets_by_le() -> Result<()> {
    // Each quantile sums its buckets (`sum by (le, ...)`, or a recorded sum),
    // so the expressions work with or without per-workload labels, across hosts.
    let rules = fs::read_to_string(deploy_dir().join("prometheus/rules.yml"))?;
    let mut exprs: Vec<String> = rules
        .split("histogram_quantile(")
        .skip(1)
        .map(str::to_string)
        .collect();
    exprs.extend(dashboard_queries(&dashboard()?).into_iter().flat_map(|q| {
        q.expr
            .split("histogram_quantile(")
            .skip(1)
            .map(str::to_string)
            .collect::<Vec<_>>()
    }));
    ensure!(exprs.len() >= 8, "{} quantiles found", exprs.len());
    for e in exprs {
        let head: String = e.split_whitespace().collect::<Vec<_>>().join(" ");
        let head = &head[..head.len().min(120)];
        ensure!(
            head.contains("sum by (le") || head.contains("le:ttft_trace_"),
            "histogram_quantile over unsummed buckets: {head}"
        );
    }
    Ok(())
}

/// Core objects of deploy/kubernetes (everything but the ServiceMonitor).
const CORE_OBJECTS: &[&str] = &[
    "namespace.yaml",
    "configmap.yaml",
    "daemonset.yaml",
    "service.yaml",
    "networkpolicy.yaml",
];

#[test]
fn kubernetes_manifests_validate_against_real_schemas() -> Result<()> {
    let test = "kubernetes_manifests_validate_against_real_schemas";
    let Some(python) = validators_python(test) else {
        return Ok(());
    };
    let dir = deploy_dir().join("kubernetes");
    // Every file is covered by one of the two checks below.
    let mut files: Vec<String> = fs::read_dir(&dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") || n.ends_with(".yml"))
        .collect();
    files.sort();
    let mut covered: Vec<String> = CORE_OBJECTS.iter().map(|s| s.to_string()).collect();
    covered.push("servicemonitor.yaml".into());
    covered.sort();
    assert_eq!(files, covered, "files of deploy/kubernetes");

    // Kubernetes' own OpenAPI schemas (bundled by kubernetes-validate),
    // strict: unknown fields are errors.
    let kv = python.with_file_name("kubernetes-validate");
    let out = run_ok(
        Command::new(&kv)
            .args(["--strict", "-k", "1.30.0"])
            .args(CORE_OBJECTS)
            .current_dir(&dir),
    )?;
    eprintln!("{out}");
    let out_latest = run_ok(
        Command::new(&kv)
            .arg("--strict")
            .args(CORE_OBJECTS)
            .current_dir(&dir),
    )?;
    eprintln!("{out_latest}");
    for f in CORE_OBJECTS {
        for o in [&out, &out_latest] {
            ensure!(
                o.lines().any(|l| l.contains(f) && l.contains(" passed ")),
                "{f} not validated: {o}"
            );
        }
    }
    ensure!(
        !out.contains("WARN") && !out_latest.contains("WARN"),
        "warnings"
    );

    // The ServiceMonitor against the prometheus-operator CRD's models.
    let out = run_ok(
        Command::new(&python)
            .arg(validate_py())
            .args(["servicemonitor", "servicemonitor.yaml"])
            .current_dir(&dir),
    )?;
    eprintln!("{out}");
    ensure!(
        out.contains("OK servicemonitor.yaml: 1 ServiceMonitor"),
        "{out}"
    );
    Ok(())
}

#[test]
fn the_daemonset_and_the_unit_are_confined() -> Result<()> {
    // Capabilities dropped but the needed ones, seccomp RuntimeDefault, a
    // read-only root (DaemonSet); the unit's sandboxing (systemd).
    let test = "the_daemonset_and_the_unit_are_confined";
    let Some(python) = validators_python(test) else {
        return Ok(());
    };
    let dir = deploy_dir();
    let out = run_ok(
        Command::new(&python)
            .arg(validate_py())
            .arg("hardening")
            .arg(dir.join("kubernetes/daemonset.yaml"))
            .arg(dir.join("systemd/ttft-trace.service")),
    )?;
    eprintln!("{out}");
    ensure!(
        out.contains("1 DaemonSet(s) confined") && out.matches("OK ").count() == 2,
        "{out}"
    );
    Ok(())
}

fn validate_py() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/validate.py")
}

#[test]
fn the_validators_reject_broken_files() -> Result<()> {
    // The checks above would pass anything if the validators were lenient:
    // a misspelt field, a wrong type and an unknown panel field must fail.
    let test = "the_validators_reject_broken_files";
    let Some(python) = validators_python(test) else {
        return Ok(());
    };
    let dir = deploy_dir();
    let tmp = ttft_trace_tests::fixtures::temp_path("deploy-broken", "d");
    fs::create_dir_all(&tmp)?;
    let ds = fs::read_to_string(dir.join("kubernetes/daemonset.yaml"))?;
    let sm = fs::read_to_string(dir.join("kubernetes/servicemonitor.yaml"))?;
    let dash = fs::read_to_string(dir.join("grafana/ttft-trace.json"))?;
    let unit = fs::read_to_string(dir.join("systemd/ttft-trace.service"))?;
    let cases = [
        // Confinement (issue 28): each loosening is refused.
        (
            "ds-seccomp.yaml",
            ds.replace("type: RuntimeDefault", "type: Unconfined"),
            "hardening",
        ),
        (
            "ds-nodrop.yaml",
            ds.replace("- ALL", "- NET_RAW"),
            "hardening",
        ),
        (
            "ds-extra-cap.yaml",
            ds.replace("- BPF ", "- NET_ADMIN "),
            "hardening",
        ),
        (
            "ds-rw-root.yaml",
            ds.replace(
                "readOnlyRootFilesystem: true",
                "readOnlyRootFilesystem: false",
            ),
            "hardening",
        ),
        (
            "ds-rw-pod-logs.yaml",
            ds.replace(
                "mountPath: /var/log/pods\n              readOnly: true",
                "mountPath: /var/log/pods\n              readOnly: false",
            ),
            "hardening",
        ),
        (
            "ds-rw-pod-logs-unsaid.yaml",
            ds.replace(
                "mountPath: /var/log/pods\n              readOnly: true",
                "mountPath: /var/log/pods",
            ),
            "hardening",
        ),
        (
            "ds-no-pod-logs.yaml",
            ds.replace("path: /var/log/pods\n", "path: /var/log/other\n"),
            "hardening",
        ),
        (
            "unit-nnp.service",
            unit.replace("NoNewPrivileges=yes", "NoNewPrivileges=no"),
            "hardening",
        ),
        (
            "unit-caps.service",
            unit.replace(
                "CapabilityBoundingSet=CAP_SYS_ADMIN",
                "CapabilityBoundingSet=CAP_NET_ADMIN CAP_SYS_ADMIN",
            ),
            "hardening",
        ),
        (
            "ds-field.yaml",
            ds.replace("hostPID: true", "hostPid: true"),
            "kv",
        ),
        (
            "ds-type.yaml",
            ds.replace("hostPID: true", "hostPID: yes-please"),
            "kv",
        ),
        (
            "sm-field.yaml",
            sm.replace("interval: 15s", "intervall: 15s"),
            "sm",
        ),
        (
            "sm-pattern.yaml",
            sm.replace("interval: 15s", "interval: 15 seconds"),
            "sm",
        ),
        (
            "dash-field.json",
            dash.replacen("\"gridPos\"", "\"gridpos\"", 1),
            "grafana",
        ),
        (
            "dash-option.json",
            dash.replacen("\"displayMode\"", "\"displaymode\"", 1),
            "grafana",
        ),
    ];
    for (name, text, check) in cases {
        let path = tmp.join(name);
        fs::write(&path, text)?;
        let mut c = match check {
            "kv" => {
                let mut c = Command::new(python.with_file_name("kubernetes-validate"));
                c.arg("--strict");
                c
            }
            other => {
                let mut c = Command::new(&python);
                c.arg(validate_py()).arg(if other == "sm" {
                    "servicemonitor"
                } else {
                    other
                });
                c
            }
        };
        let out = c.arg(&path).output()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        eprintln!(
            "{name}: {}",
            text.lines().find(|l| l.contains("ERROR")).unwrap_or(&text)
        );
        ensure!(
            !out.status.success() && text.contains("ERROR"),
            "{name} passed: {text}"
        );
    }
    let _ = fs::remove_dir_all(&tmp);
    Ok(())
}

#[test]
fn configmap_holds_the_daemons_config_and_the_daemonset_mounts_what_it_needs() -> Result<()> {
    let test = "configmap_holds_the_daemons_config_and_the_daemonset_mounts_what_it_needs";
    let Some(python) = validators_python(test) else {
        return Ok(());
    };
    let dir = deploy_dir().join("kubernetes");
    // The YAML documents as JSON, and config.toml parsed by Python's tomllib.
    let script = "import json, sys, tomllib, yaml\n\
        docs = {}\n\
        for f in sys.argv[1:]:\n\
        \x20   for d in yaml.safe_load_all(open(f)):\n\
        \x20       docs[d['kind']] = d\n\
        docs['config'] = tomllib.loads(docs['ConfigMap']['data']['config.toml'])\n\
        print(json.dumps(docs))\n";
    let out = run_ok(
        Command::new(&python)
            .args(["-c", script])
            .args(CORE_OBJECTS)
            .arg("servicemonitor.yaml")
            .current_dir(&dir),
    )?;
    let docs: Value = serde_json::from_str(&out).context("the documents as JSON")?;
    assert_eq!(
        docs["config"],
        json!({
            "listen": "0.0.0.0:9464",
            "jsonl": "/var/log/ttft-trace/requests.jsonl",
            "slo_ms": 350,
            "discovery": {"comm": "^(python|vllm|tritonserver)", "cgroup_prefix": "/kubepods", "ports": [8000]},
            "labels": {"pid": false, "max_sets": 100, "max_sets_per_pod": 25, "retire_after_s": 300, "pod_log_dir": "/var/log/pods"},
            "quotas": {"listeners": 1024, "threads": 4096, "sampled_threads": 4096,
                       "otlp_attribute_sets": 250},
            "nvml": {"enabled": true, "period_ms": 100},
        }),
        "config.toml of the ConfigMap"
    );
    let pod = &docs["DaemonSet"]["spec"]["template"]["spec"];
    assert_eq!(pod["hostPID"], true);
    let c = &pod["containers"][0];
    assert_eq!(
        c["args"],
        json!(["daemon", "--config", "/etc/ttft-trace/config.toml"])
    );
    let caps = &c["securityContext"]["capabilities"]["add"];
    for cap in [
        "SYS_ADMIN",
        "BPF",
        "PERFMON",
        "SYS_PTRACE",
        "DAC_READ_SEARCH",
    ] {
        ensure!(
            caps.as_array().is_some_and(|a| a.contains(&json!(cap))),
            "{cap} in {caps}"
        );
    }
    ensure!(
        c["securityContext"]["privileged"] == false,
        "not privileged"
    );
    let mounts = c["volumeMounts"].as_array().context("mounts")?;
    let volumes = pod["volumes"].as_array().context("volumes")?;
    for path in [
        "/sys/kernel/tracing",
        "/sys/kernel/debug",
        "/sys/kernel/btf",
        "/var/log/pods",
    ] {
        let m = mounts
            .iter()
            .find(|m| m["mountPath"] == path)
            .with_context(|| format!("{path} not mounted"))?;
        assert_eq!(m["readOnly"], true, "{path} read-only");
        let v = volumes
            .iter()
            .find(|v| v["name"] == m["name"])
            .context("volume")?;
        assert_eq!(v["hostPath"]["path"], path, "{path} is the host's");
    }
    let cfg = mounts
        .iter()
        .find(|m| m["mountPath"] == "/etc/ttft-trace")
        .context("config mount")?;
    let cfg_vol = volumes
        .iter()
        .find(|v| v["name"] == cfg["name"])
        .context("config volume")?;
    assert_eq!(
        cfg_vol["configMap"]["name"],
        docs["ConfigMap"]["metadata"]["name"]
    );
    // Scraping: the port the config listens on, annotations, Service and ServiceMonitor.
    assert_eq!(c["ports"][0]["containerPort"], 9464);
    let ann = &docs["DaemonSet"]["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(ann["prometheus.io/scrape"], "true");
    assert_eq!(ann["prometheus.io/port"], "9464");
    let labels = &docs["DaemonSet"]["spec"]["template"]["metadata"]["labels"];
    for (k, v) in docs["Service"]["spec"]["selector"]
        .as_object()
        .context("selector")?
    {
        assert_eq!(&labels[k], v, "Service selects the pods");
    }
    let port_name = &docs["Service"]["spec"]["ports"][0]["name"];
    assert_eq!(
        &docs["ServiceMonitor"]["spec"]["endpoints"][0]["port"],
        port_name
    );
    for (k, v) in docs["ServiceMonitor"]["spec"]["selector"]["matchLabels"]
        .as_object()
        .context("sm selector")?
    {
        assert_eq!(
            &docs["Service"]["metadata"]["labels"][k], v,
            "ServiceMonitor selects the Service"
        );
    }
    Ok(())
}

#[test]
fn grafana_dashboard_decodes_with_grafanas_schema() -> Result<()> {
    let test = "grafana_dashboard_decodes_with_grafanas_schema";
    let Some(python) = validators_python(test) else {
        return Ok(());
    };
    let out = run_ok(
        Command::new(&python)
            .arg(validate_py())
            .arg("grafana")
            .arg(deploy_dir().join("grafana/ttft-trace.json")),
    )?;
    eprintln!("{out}");
    ensure!(out.contains("OK ") && !out.contains("ERROR"), "{out}");
    Ok(())
}

fn panel<'a>(d: &'a Value, title: &str) -> &'a Value {
    d["panels"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["title"] == title))
        .unwrap_or_else(|| panic!("no panel {title:?}"))
}

#[test]
fn grafana_dashboard_has_the_panels_and_variables() -> Result<()> {
    let d = dashboard()?;
    let vars = d["templating"]["list"].as_array().context("variables")?;
    let var = |name: &str| {
        vars.iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no variable {name}"))
    };
    let ds = var("datasource");
    assert_eq!(ds["type"], "datasource");
    assert_eq!(ds["query"], "prometheus");
    for name in ["instance", "namespace", "pod", "container", "comm"] {
        let v = var(name);
        assert_eq!(v["type"], "query", "{name}");
        assert_eq!(v["includeAll"], true, "{name}");
        assert_eq!(
            v["allValue"], ".*",
            "{name}: All must match an absent label too"
        );
        assert_eq!(v["datasource"]["uid"], "${datasource}", "{name}");
    }
    let mut panels = 0;
    for p in d["panels"].as_array().context("panels")? {
        if p["type"] == "row" {
            continue;
        }
        panels += 1;
        let title = &p["title"];
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{title}");
        let targets = p["targets"].as_array().context("targets")?;
        ensure!(!targets.is_empty(), "{title} has no query");
        for t in targets {
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{title}");
            ensure!(t["expr"].as_str().is_some_and(|e| !e.is_empty()), "{title}");
        }
        for k in ["h", "w", "x", "y"] {
            ensure!(p["gridPos"][k].is_u64(), "{title}: gridPos.{k}");
        }
    }
    ensure!(panels >= 10, "{panels} panels");
    let exprs = |title: &str| -> Vec<String> {
        panel(&d, title)["targets"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| t["expr"].as_str().unwrap_or_default().to_string())
            .collect()
    };
    // TTFT P50/P95/P99 by workload.
    let q = exprs("TTFT P50 / P95 / P99 by workload");
    for (e, quantile) in q.iter().zip(["0.5", "0.95", "0.99"]) {
        ensure!(
            e.starts_with(&format!(
                "histogram_quantile({quantile}, sum by (le, namespace, pod, container, comm)"
            )),
            "{e}"
        );
    }
    // The breakdown, stacked.
    let b = panel(&d, "TTFT breakdown (mean): queue + GPU + egress");
    assert_eq!(
        b["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"],
        "normal"
    );
    let be = exprs("TTFT breakdown (mean): queue + GPU + egress").join("\n");
    for part in ["queue", "gpu", "egress"] {
        ensure!(
            be.contains(&format!("ttft_trace_request_{part}_seconds_sum")),
            "{part}"
        );
    }
    // Cause mix, GPU clocks and memory.
    ensure!(
        exprs("Slow requests by cause")[0]
            .starts_with("sum by (cause) (rate(ttft_trace_slow_requests_total")
    );
    ensure!(
        exprs("Cause mix over the range")[0]
            .starts_with("sum by (cause) (increase(ttft_trace_slow_requests_total")
    );
    ensure!(exprs("GPU SM clock")[0].contains("ttft_trace_gpu_sm_clock_hertz"));
    ensure!(exprs("GPU memory used")[0].contains("ttft_trace_gpu_memory_used_bytes"));
    // Every query filters by the workload variables or is a per-GPU one.
    for q in dashboard_queries(&d) {
        ensure!(!q.expr.contains('$'), "unsubstituted variable in {q:?}");
    }
    Ok(())
}
