//! A real Prometheus server (Debian's `prometheus` package, installed by
//! `cargo xtask setup`) for the tests: started on loopback with its own
//! generated configuration and data directory, scraping one target every
//! second; queried over its HTTP API; killed, and its directory removed, on
//! drop. Also where the deploy/ validators are found.

use std::{
    fs,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

use crate::fixtures::{self, ChildGuard};
use crate::skip_or_fail;

/// The repository's deploy/ folder.
pub fn deploy_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(|p| p.join("deploy"))
        .unwrap_or_else(|| PathBuf::from("deploy"))
}

/// `tool` from PATH (or /usr/bin), or None with the reason printed; a
/// missing tool fails instead when `TTFT_TRACE_REQUIRE_FIXTURES` is set.
pub fn require_tool(tool: &str, test: &str) -> Option<PathBuf> {
    let found = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .chain([PathBuf::from("/usr/bin")])
        .map(|d| d.join(tool))
        .find(|p| p.is_file());
    if found.is_none() {
        skip_or_fail(
            test,
            &format!("{tool} not found (cargo xtask setup installs it, as root)"),
        );
    }
    found
}

/// The validators' venv python (`cargo xtask setup` makes it from
/// tests/deploy/requirements.txt), or None with the reason, like
/// [`require_tool`].
pub fn validators_python(test: &str) -> Option<PathBuf> {
    let python = fixtures::cache_dir().join("validators-venv/bin/python");
    if python.is_file() {
        Some(python)
    } else {
        skip_or_fail(
            test,
            &format!(
                "{} not found (cargo xtask setup makes it)",
                python.display()
            ),
        );
        None
    }
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Runs `c` and returns its combined output; an error with it on failure.
pub fn run_ok(c: &mut Command) -> Result<String> {
    let out = c.output().with_context(|| format!("running {c:?}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        bail!("{c:?} failed ({}):\n{text}", out.status);
    }
    Ok(text)
}

/// A running Prometheus; killed and its directory removed on drop.
pub struct Prometheus {
    child: ChildGuard,
    dir: PathBuf,
    pub addr: SocketAddr,
    pub job: String,
}

impl Prometheus {
    /// Starts `prometheus` on a free loopback port, scraping `target`'s
    /// /metrics every second as job `ttft-trace`, evaluating `rule_files`
    /// every second, and waits until it is ready.
    pub fn start(bin: &Path, target: SocketAddr, rule_files: &[PathBuf]) -> Result<Self> {
        let dir = fixtures::temp_path("prometheus", "d");
        fs::create_dir_all(dir.join("data"))?;
        let rules: Vec<String> = rule_files
            .iter()
            .map(|p| format!("  - {:?}\n", p.display().to_string()))
            .collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n{}\
             scrape_configs:\n  - job_name: ttft-trace\n    static_configs:\n      - targets: [\"{target}\"]\n",
            if rules.is_empty() {
                "  []\n".to_string()
            } else {
                rules.concat()
            }
        );
        fs::write(dir.join("prometheus.yml"), config)?;
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let child = Command::new(bin)
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let p = Self {
            child: ChildGuard::new(child),
            dir,
            addr,
            job: "ttft-trace".into(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if matches!(p.get("/-/ready"), Ok((200, _))) {
                return Ok(p);
            }
            if Instant::now() > deadline {
                bail!("prometheus at {addr} not ready within 30 s");
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// GET `path` from the server: (status code, body).
    pub fn get(&self, path: &str) -> Result<(u16, String)> {
        http_get_body(self.addr, path)
    }

    /// An instant query at the current time: the API's `data` on success,
    /// else an error with Prometheus' own message (a parse error among them).
    pub fn query(&self, expr: &str) -> Result<Value> {
        let (code, body) = self.get(&format!("/api/v1/query?query={}", url_encode(expr)))?;
        let v: Value =
            serde_json::from_str(&body).with_context(|| format!("HTTP {code}: {body}"))?;
        if v["status"] != "success" {
            bail!(
                "query {expr:?}: HTTP {code}, {}: {}",
                v["errorType"],
                v["error"]
            );
        }
        Ok(v["data"].clone())
    }

    /// The samples of an instant vector query: (labels, value).
    pub fn query_vector(&self, expr: &str) -> Result<Vec<(Value, f64)>> {
        let data = self.query(expr)?;
        let result = data["result"].as_array().cloned().unwrap_or_default();
        result
            .iter()
            .map(|s| {
                let v = s["value"][1]
                    .as_str()
                    .and_then(|v| v.parse::<f64>().ok())
                    .with_context(|| format!("odd sample {s}"))?;
                Ok((s["metric"].clone(), v))
            })
            .collect()
    }

    /// The one value of a query that must return exactly one sample.
    pub fn query_scalar(&self, expr: &str) -> Result<f64> {
        match self.query_vector(expr)?.as_slice() {
            [(_, v)] => Ok(*v),
            other => bail!("query {expr:?} returned {} samples: {other:?}", other.len()),
        }
    }

    /// The rule groups as /api/v1/rules reports them (health, last error).
    pub fn query_rules(&self) -> Result<Value> {
        let (code, body) = self.get("/api/v1/rules")?;
        let v: Value =
            serde_json::from_str(&body).with_context(|| format!("HTTP {code}: {body}"))?;
        Ok(v["data"]["groups"].clone())
    }

    /// Time (Unix seconds) of the last scrape of the target, if any.
    pub fn last_scrape(&self) -> Result<Option<f64>> {
        let v = self.query_vector(&format!("timestamp(up{{job=\"{}\"}})", self.job))?;
        Ok(v.first().map(|(_, t)| *t))
    }

    /// Waits until `n` scrapes have started after this call, the last of
    /// which found the target up.
    pub fn wait_scrapes(&self, n: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut last = self.last_scrape()?;
        let mut seen = 0;
        while seen < n {
            if Instant::now() > deadline {
                bail!("only {seen} of {n} scrapes in {timeout:?}");
            }
            thread::sleep(Duration::from_millis(100));
            let now = self.last_scrape()?;
            if now.is_some() && now != last {
                seen += 1;
                last = now;
            }
        }
        let up = self.query_scalar(&format!("up{{job=\"{}\"}}", self.job))?;
        if up != 1.0 {
            bail!("the last scrape of the target failed (up = {up})");
        }
        Ok(())
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        // Killed (and reaped) before its directory goes.
        let _ = self.child.wait_timeout(Duration::ZERO);
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// GET `path` over HTTP/1.0 (the body ends at the close, never chunked):
/// the status code and the body alone.
pub fn http_get_body(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("no HTTP head in {text:?}"))?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("bad status line in {head:?}"))?;
    Ok((code, body.to_string()))
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
pub fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The range that stands for Grafana's `$__rate_interval` when a dashboard
/// expression is evaluated here (at least 4 scrapes of 1 s).
pub const RATE_INTERVAL: &str = "1m";
/// The range that stands for Grafana's `$__range`.
pub const RANGE: &str = "5m";

/// One query of a Grafana dashboard panel, with the dashboard's variables
/// replaced so that Prometheus can evaluate it: every template variable by
/// `.*` (Grafana's "All" here), `$__rate_interval` by [`RATE_INTERVAL`] and
/// `$__range` by [`RANGE`].
#[derive(Debug, Clone)]
pub struct PanelQuery {
    pub panel: String,
    pub ref_id: String,
    pub expr: String,
}

/// Every target of every panel of `dashboard` (rows' nested panels too).
pub fn dashboard_queries(dashboard: &Value) -> Vec<PanelQuery> {
    let vars: Vec<String> = dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["name"].as_str().map(str::to_string))
        .collect();
    let substitute = |expr: &str| {
        let mut e = expr
            .replace("$__rate_interval", RATE_INTERVAL)
            .replace("$__range", RANGE);
        for v in &vars {
            e = e.replace(&format!("${{{v}}}"), ".*");
            e = e.replace(&format!("${v}"), ".*");
        }
        e
    };
    let mut panels: Vec<&Value> = Vec::new();
    for p in dashboard["panels"].as_array().into_iter().flatten() {
        panels.push(p);
        panels.extend(p["panels"].as_array().into_iter().flatten());
    }
    panels
        .iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or_default().to_string();
            p["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .map(move |t| PanelQuery {
                    panel: title.clone(),
                    ref_id: t["refId"].as_str().unwrap_or_default().to_string(),
                    expr: t["expr"].as_str().unwrap_or_default().to_string(),
                })
        })
        .map(|q| PanelQuery {
            expr: substitute(&q.expr),
            ..q
        })
        .collect()
}

/// The dashboard of deploy/grafana, parsed.
pub fn dashboard() -> Result<Value> {
    let path = deploy_dir().join("grafana/ttft-trace.json");
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}
