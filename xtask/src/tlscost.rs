//! What reading TLS costs the traced server (issue 30): requests per second
//! over one kept-alive TLS connection, and the time of one `SSL_write`
//! timed inside the server, for a server traced by `attach` and an identical
//! one untraced, in the same run: with a socket BIO (blocking `ssl`) and
//! with a memory BIO (`asyncio`, its records bound by their ciphertext);
//! and the blocking server in plain HTTP, traced and not, for the share a
//! followed connection costs without TLS (`tests/stacks/tls_bench.py`).
//! Each pair's rounds alternate; medians. Stated, not judged.

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Child, Command, Stdio},
};

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::{Value, json};

use crate::{
    attachtime::wait_for_detaches,
    demo::{interrupt, start_tracer},
};

/// Requests and `SSL_write` calls per client run.
const REQUESTS: u32 = 2_000;
const WRITES: u32 = 20_000;

/// A bench server; `cert` None serves plain HTTP.
struct Server {
    child: Child,
    port: u16,
}

/// How the bench server serves.
#[derive(Clone, Copy)]
enum Kind {
    /// A thread per connection on blocking sockets (TLS: a socket BIO).
    Blocking,
    /// `asyncio` (TLS: a memory BIO).
    Asyncio,
}

impl Server {
    fn start(root: &Path, cert: Option<(&Path, &Path)>, kind: Kind) -> Result<Self> {
        let (c, k) = cert.map_or(("-".into(), "-".into()), |(c, k)| {
            (c.display().to_string(), k.display().to_string())
        });
        let mut child = Command::new("python3")
            .arg(root.join("tests/stacks/tls_bench.py"))
            .args(["server", &c, &k])
            .arg(root.join("target/fixtures/libcudart.so.12"))
            .args(matches!(kind, Kind::Asyncio).then_some("asyncio"))
            .stdout(Stdio::piped())
            .spawn()
            .context("starting tests/stacks/tls_bench.py")?;
        let out = child.stdout.take().context("server stdout")?;
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line)?;
        let port = line.trim().parse().context("the bench server's port")?;
        Ok(Self { child, port })
    }

    /// One client run: (requests/s, ns per write).
    fn load(&self, root: &Path, plain: bool) -> Result<(f64, f64)> {
        let mut c = Command::new("python3");
        c.arg(root.join("tests/stacks/tls_bench.py")).args([
            "client",
            &self.port.to_string(),
            &REQUESTS.to_string(),
            &WRITES.to_string(),
        ]);
        if plain {
            c.arg("plain");
        }
        let out = c.output().context("running the bench client")?;
        ensure!(out.status.success(), "bench client: {out:?}");
        let v: Value = serde_json::from_slice(&out.stdout)?;
        let f = |k: &str| v[k].as_f64().with_context(|| format!("no {k} in {v}"));
        Ok((f("requests_per_s")?, f("ns_per_write")?))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A self-signed certificate for the bench servers.
fn certificate(dir: &Path) -> Result<()> {
    let out = Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args(["-subj", "/CN=localhost", "-keyout"])
        .arg(dir.join("key.pem"))
        .arg("-out")
        .arg(dir.join("cert.pem"))
        .output()
        .context("running openssl")?;
    if !out.status.success() {
        bail!("openssl: {out:?}");
    }
    Ok(())
}

/// Alternates `rounds` client runs on an untraced and a traced server
/// (`cert` None: plain HTTP), the latter under `attach`: (untraced,
/// traced) runs.
fn pair(
    root: &Path,
    cert: Option<(&Path, &Path)>,
    kind: Kind,
    rounds: usize,
) -> Result<[Vec<(f64, f64)>; 2]> {
    let (untraced, traced) = (
        Server::start(root, cert, kind)?,
        Server::start(root, cert, kind)?,
    );
    let args = [
        "--pid".to_string(),
        traced.child.id().to_string(),
        "--no-nvml".into(),
        "--no-listen".into(),
    ];
    let mut tracer = start_tracer(root, "attach", &args, "following requests")?;
    // The TLS library's probes follow the port's line.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let mut runs: [Vec<(f64, f64)>; 2] = Default::default();
    let plain = cert.is_none();
    for _ in 0..rounds {
        runs[0].push(untraced.load(root, plain)?);
        runs[1].push(traced.load(root, plain)?);
    }
    interrupt(&mut tracer, false, std::time::Duration::from_secs(30))?;
    wait_for_detaches()?;
    Ok(runs)
}

/// Runs `rounds` rounds; returns the results (stated).
pub fn run(root: &Path, rounds: usize) -> Result<Value> {
    let dir = root.join("target/bench/tls");
    std::fs::create_dir_all(&dir)?;
    certificate(&dir)?;
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let [tu, tt] = pair(root, Some((&cert, &key)), Kind::Blocking, rounds)?;
    let [pu, pt] = pair(root, None, Kind::Blocking, rounds)?;
    let [au, at] = pair(root, Some((&cert, &key)), Kind::Asyncio, rounds)?;
    let runs = [tu, tt, pu, pt, au, at];
    let med = |i: usize| {
        (
            median(runs[i].iter().map(|r| r.0).collect()),
            median(runs[i].iter().map(|r| r.1).collect()),
        )
    };
    let ((tu_rps, tu_ns), (tt_rps, tt_ns)) = (med(0), med(1));
    let ((pu_rps, pu_ns), (pt_rps, pt_ns)) = (med(2), med(3));
    let ((au_rps, au_ns), (at_rps, at_ns)) = (med(4), med(5));
    println!(
        "TLS (CPython ssl, socket BIO): {tu_rps:.0} requests/s untraced, {tt_rps:.0} traced \
         ({:+.0} %); one SSL_write {:.1} µs untraced, {:.1} µs traced ({:+.1} µs)",
        (tt_rps / tu_rps - 1.0) * 100.0,
        tu_ns / 1e3,
        tt_ns / 1e3,
        (tt_ns - tu_ns) / 1e3
    );
    println!(
        "the same in plain HTTP: {pu_rps:.0} requests/s untraced, {pt_rps:.0} traced ({:+.0} %); \
         one send {:.1} µs untraced, {:.1} µs traced ({:+.1} µs)",
        (pt_rps / pu_rps - 1.0) * 100.0,
        pu_ns / 1e3,
        pt_ns / 1e3,
        (pt_ns - pu_ns) / 1e3
    );
    println!(
        "TLS (asyncio, memory BIO): {au_rps:.0} requests/s untraced, {at_rps:.0} traced \
         ({:+.0} %); one write (SSL_write and its send) {:.1} µs untraced, {:.1} µs traced \
         ({:+.1} µs)",
        (at_rps / au_rps - 1.0) * 100.0,
        au_ns / 1e3,
        at_ns / 1e3,
        (at_ns - au_ns) / 1e3
    );
    let pairs = |i: usize| {
        runs[i]
            .iter()
            .map(|r| json!([r.0, r.1]))
            .collect::<Vec<_>>()
    };
    Ok(json!({
        "requests": REQUESTS, "writes": WRITES, "rounds": rounds,
        "tls": {"untraced_rps": tu_rps, "traced_rps": tt_rps,
                "untraced_ns_per_write": tu_ns, "traced_ns_per_write": tt_ns,
                "runs_untraced": pairs(0), "runs_traced": pairs(1)},
        "plain": {"untraced_rps": pu_rps, "traced_rps": pt_rps,
                  "untraced_ns_per_send": pu_ns, "traced_ns_per_send": pt_ns,
                  "runs_untraced": pairs(2), "runs_traced": pairs(3)},
        "tls_asyncio": {"untraced_rps": au_rps, "traced_rps": at_rps,
                        "untraced_ns_per_write": au_ns, "traced_ns_per_write": at_ns,
                        "runs_untraced": pairs(4), "runs_traced": pairs(5)},
    }))
}
