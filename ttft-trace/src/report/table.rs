//! The report as text, in the style of `vllm bench serve`: a banner, one
//! `label: value` row per summary figure, then the latency table, the share
//! within the objective, the cause mix and the slowest requests.

use std::fmt::Write as _;

use super::stats::{Run, Stats};
use crate::{
    jsonl_schema::{Evidence, Request},
    requests::Figure,
};

const WIDTH: usize = 50;

/// Nanoseconds as milliseconds, two decimals.
pub fn ms(ns: f64) -> String {
    format!("{:.2}", ns / 1e6)
}

fn banner(out: &mut String, title: &str, fill: char) {
    let title = format!(" {title} ");
    let pad = WIDTH.saturating_sub(title.chars().count());
    let left: String = std::iter::repeat_n(fill, pad / 2).collect();
    let right: String = std::iter::repeat_n(fill, pad - pad / 2).collect();
    let _ = writeln!(out, "{left}{title}{right}");
}

fn row(out: &mut String, label: &str, value: impl std::fmt::Display) {
    let _ = writeln!(out, "{label:<40} {value}");
}

/// The share of requests within the objective, as a percentage.
fn share(run: &Run) -> String {
    run.within_slo()
        .map_or_else(|| "n/a".into(), |s| format!("{:.2}%", s * 100.0))
}

/// One run's report.
pub fn single(run: &Run) -> String {
    let mut out = String::new();
    banner(&mut out, "ttft-trace report", '=');
    row(&mut out, "File:", &run.name);
    row(&mut out, "Requests traced:", run.lines.requests);
    row(&mut out, "Successful requests:", run.successful());
    row(
        &mut out,
        "Duration (s):",
        format!("{:.2}", run.duration_s()),
    );
    if run.duration_s() > 0.0 {
        let rate = run.successful() as f64 / run.duration_s();
        row(
            &mut out,
            "Request throughput (req/s):",
            format!("{rate:.2}"),
        );
    }
    let outcomes: Vec<String> = run
        .outcomes
        .iter()
        .map(|(o, n)| format!("{o} {n}"))
        .collect();
    row(&mut out, "Outcomes:", outcomes.join(", "));
    let r = &run.retries;
    if run.retried > 0 {
        let seen = if r.count > 0 {
            format!(
                "; the TTFT their users saw: median {} ms, P99 {} ms",
                ms(r.median),
                ms(r.p99)
            )
        } else {
            String::new()
        };
        row(
            &mut out,
            "Retries of interrupted requests:",
            format!("{}{seen}", run.retried),
        );
    }
    let h = &run.tls_handshakes;
    if h.count > 0 {
        let versions: Vec<String> = run
            .tls_versions
            .iter()
            .map(|(v, n)| format!("TLS {v} {n}"))
            .collect();
        row(
            &mut out,
            "TLS handshakes:",
            format!(
                "{} ({}): median {} ms, P99 {} ms",
                h.count,
                versions.join(", "),
                ms(h.median),
                ms(h.p99)
            ),
        );
    }
    row(
        &mut out,
        &format!("Within objective (TTFT <= {} ms):", ms(run.slo_ns as f64)),
        share(run),
    );
    skipped(&mut out, run);
    banner(&mut out, "Latency (ms)", '-');
    let _ = writeln!(
        out,
        "{:<7}{:>9}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}",
        "", "n", "mean", "median", "P90", "P99", "P99.9", "max"
    );
    for (f, s) in &run.figures {
        let _ = writeln!(
            out,
            "{:<7}{:>9}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}",
            f.label(),
            s.count,
            ms(s.mean),
            ms(s.median),
            ms(s.p90),
            ms(s.p99),
            ms(s.p999),
            ms(s.max)
        );
    }
    cause_mix(&mut out, run);
    banner(&mut out, "Slowest requests", '-');
    for (i, r) in run.slowest.iter().enumerate() {
        slow_request(&mut out, run, i + 1, r);
    }
    if run.slowest.is_empty() {
        let _ = writeln!(out, "(no request with a first token)");
    }
    let _ = writeln!(out, "{}", "=".repeat(WIDTH));
    out
}

fn skipped(out: &mut String, run: &Run) {
    let l = &run.lines;
    if l.bad + l.too_long > 0 {
        let mut why = format!("{} not readable, {} too long", l.bad, l.too_long);
        if let Some((n, e)) = &l.first_bad {
            let _ = write!(why, " (line {n}: {e})");
        }
        row(out, "Lines skipped:", why);
    }
}

fn cause_mix(out: &mut String, run: &Run) {
    banner(out, "Causes of slow requests", '-');
    row(out, "Judged slow by the tracer:", run.slow);
    for (class, t) in &run.causes {
        row(
            out,
            &format!("  {class}:"),
            format!(
                "{} ({}), {} ms explained",
                t.requests,
                percent(t.requests, run.slow),
                ms(t.explained_ns as f64)
            ),
        );
    }
    if run.unexplained > 0 {
        row(
            out,
            "  unexplained:",
            format!(
                "{} ({})",
                run.unexplained,
                percent(run.unexplained, run.slow)
            ),
        );
    }
}

fn percent(n: u64, of: u64) -> String {
    if of == 0 {
        return "-".into();
    }
    format!("{:.1}%", n as f64 * 100.0 / of as f64)
}

fn slow_request(out: &mut String, run: &Run, rank: usize, r: &Request) {
    let ttft = r.counted_ttft_ns().unwrap_or(0) as f64;
    let at = r.t_arrive_ns.saturating_sub(run.start_ns) as f64 / 1e9;
    let breakdown = match (r.queue_ns, r.gpu_ns, r.egress_ns) {
        (Some(q), Some(g), Some(e)) => format!(
            " = queue {} + GPU {} + egress {}",
            ms(q as f64),
            ms(g as f64),
            ms(e as f64)
        ),
        _ => " (no GPU episode joined)".into(),
    };
    let status = r.http_status.map_or_else(|| "-".into(), |s| s.to_string());
    let _ = writeln!(
        out,
        "#{rank} at +{at:.3} s  TTFT {} ms{breakdown}",
        ms(ttft)
    );
    let _ = writeln!(
        out,
        "    {} {status}, {}:{} req {} on {}, pid {} ({})",
        r.outcome, r.client_addr, r.client_port, r.request_index, r.conn, r.pid, r.workload.comm
    );
    if r.slow {
        let causes: Vec<String> = r
            .causes
            .iter()
            .map(|c| format!("{} {} ms", c.class, ms(c.explained_ns as f64)))
            .collect();
        let causes = if causes.is_empty() {
            "unexplained".into()
        } else {
            causes.join(", ")
        };
        let _ = writeln!(out, "    causes: {causes}");
    }
    if let Some(e) = &r.evidence {
        let items = evidence_items(e);
        if !items.is_empty() {
            let _ = writeln!(out, "    evidence: {}", items.join("; "));
        }
    } else if r.tcp_retransmits > 0 {
        let _ = writeln!(out, "    evidence: {} TCP retransmits", r.tcp_retransmits);
    }
}

/// The kernel's evidence over a request, the non-zero parts, in words.
pub fn evidence_items(e: &Evidence) -> Vec<String> {
    let mut items = Vec::new();
    if e.runq_ns > 0 {
        items.push(format!(
            "run queue {} ms (longest wait {} ms)",
            ms(e.runq_ns as f64),
            ms(e.runq_max_ns as f64)
        ));
    }
    if e.cpu_stage_thread_max_ns > 0 {
        items.push(format!(
            "CPU stage: longest thread {} ms, on CPU {} ms, blocked {} ms",
            ms(e.cpu_stage_thread_max_ns as f64),
            ms(e.cpu_stage_oncpu_ns as f64),
            ms(e.cpu_stage_blocked_ns as f64)
        ));
    }
    if e.gpu_thread_blocked_ns > 0 {
        items.push(format!(
            "GPU thread blocked {} ms",
            ms(e.gpu_thread_blocked_ns as f64)
        ));
    }
    if e.retransmits > 0 {
        items.push(format!("{} TCP retransmits", e.retransmits));
    }
    if e.resets > 0 {
        items.push(format!("{} TCP resets", e.resets));
    }
    if e.large_copies > 0 {
        items.push(format!(
            "{} large copies, {} MiB (H2D {} MiB, D2H {} MiB)",
            e.large_copies,
            mib(e.large_copy_bytes),
            mib(e.large_copy_h2d_bytes),
            mib(e.large_copy_d2h_bytes)
        ));
    }
    if e.first_gpu_work_in_window {
        items.push("the process's first GPU work".into());
    }
    items
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / f64::from(1 << 20))
}

/// Two runs side by side: A, B, and B − A.
pub fn compare(a: &Run, b: &Run) -> String {
    let mut out = String::new();
    banner(&mut out, "ttft-trace report: comparison", '=');
    let _ = writeln!(out, "A: {}", a.name);
    let _ = writeln!(out, "B: {}", b.name);
    let line = |out: &mut String, label: &str, x: String, y: String, d: String| {
        let _ = writeln!(out, "{label:<22}{x:>12}{y:>12}{d:>22}");
    };
    line(&mut out, "", "A".into(), "B".into(), "B - A".into());
    let counts = |out: &mut String, label: &str, x: u64, y: u64| {
        line(
            out,
            label,
            x.to_string(),
            y.to_string(),
            format!("{:+}", i128::from(y) - i128::from(x)),
        );
    };
    counts(
        &mut out,
        "Requests traced",
        a.lines.requests,
        b.lines.requests,
    );
    counts(&mut out, "Successful", a.successful(), b.successful());
    counts(&mut out, "Judged slow", a.slow, b.slow);
    let (sa, sb) = (a.within_slo(), b.within_slo());
    let pct = |s: Option<f64>| s.map_or_else(|| "n/a".into(), |s| format!("{:.2}%", s * 100.0));
    let diff = match (sa, sb) {
        (Some(x), Some(y)) => format!("{:+.2} pts", (y - x) * 100.0),
        _ => "-".into(),
    };
    line(
        &mut out,
        &format!("Within {} ms", ms(a.slo_ns as f64)),
        pct(sa),
        pct(sb),
        diff,
    );
    banner(&mut out, "Latency (ms)", '-');
    for f in Figure::ALL {
        let (x, y) = (a.stats(f), b.stats(f));
        let rows: [(&str, Pick); 5] = [
            ("mean", |s| s.mean),
            ("median", |s| s.median),
            ("P90", |s| s.p90),
            ("P99", |s| s.p99),
            ("P99.9", |s| s.p999),
        ];
        for (name, get) in rows {
            let label = format!("{} {name}", f.label());
            let d = match (x.count, y.count) {
                (0, _) | (_, 0) => "-".into(),
                _ => delta(get(&x), get(&y)),
            };
            let show = |s: &Stats| {
                if s.count == 0 { "-".into() } else { ms(get(s)) }
            };
            line(&mut out, &label, show(&x), show(&y), d);
        }
    }
    banner(&mut out, "Causes of slow requests", '-');
    let classes: std::collections::BTreeSet<&String> =
        a.causes.keys().chain(b.causes.keys()).collect();
    for class in classes {
        let n = |r: &Run| r.causes.get(class).map_or(0, |t| t.requests);
        counts(&mut out, class, n(a), n(b));
    }
    counts(&mut out, "unexplained", a.unexplained, b.unexplained);
    let _ = writeln!(out, "{}", "=".repeat(WIDTH));
    out
}

/// Reads one statistic of a figure.
type Pick = fn(&Stats) -> f64;

/// `y − x` in ms, and relative to `x`.
fn delta(x: f64, y: f64) -> String {
    let d = ms(y - x);
    let d = if d.starts_with('-') {
        d
    } else {
        format!("+{d}")
    };
    if x > 0.0 {
        format!("{d} ({:+.1}%)", (y - x) * 100.0 / x)
    } else {
        d
    }
}
