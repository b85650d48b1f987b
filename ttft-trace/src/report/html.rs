//! The report as one self-contained HTML page: inline SVG drawn here, inline
//! CSS, no script, font or any other external resource, so that it opens
//! offline and can be mailed. Three figures: the TTFT CDF with the
//! objective, TTFT over time, and the slowest requests as a waterfall.

use std::fmt::Write as _;

use super::{
    stats::Run,
    svg::{Frame, Scale, axes, escape, nice_max},
    table::{evidence_items, ms},
};
use crate::jsonl_schema::{Cause, Request, StallWindow};

const WIDTH: f64 = 1100.0;
/// Runs' colours: A, then B.
const COLOURS: [&str; 2] = ["#1f77b4", "#ff7f0e"];
const OVER: &str = "#d62728";
/// Points drawn per curve or scatter; beyond that the run is thinned
/// evenly (the table keeps every value).
const MAX_POINTS: usize = 4000;

/// The waterfall's marks: SVG class and colour.
type Mark = (&'static str, &'static str);
const QUEUE: Mark = ("queue", "#9aa5b1");
const GPU: Mark = ("gpu", "#2ca02c");
const EGRESS: Mark = ("egress", "#ff7f0e");
const NO_BREAKDOWN: Mark = ("ttft", "#c7c7c7");
const RESPONSE: Mark = ("response", "#1f77b4");
const RUNQ: Mark = ("runq", "#9467bd");
const CPU_STAGE: Mark = ("cpu-stage", "#8c564b");
const COPIES: Mark = ("copies", "#e377c2");
const STALL: Mark = ("stall", "#17becf");

/// The page for `runs` (one, or two compared); `text` is the terminal
/// report, shown below the figures.
pub fn page(runs: &[&Run], text: &str) -> String {
    let mut out = String::new();
    let title = match runs {
        [a, b] => format!("ttft-trace report: {} vs {}", a.name, b.name),
        _ => format!(
            "ttft-trace report: {}",
            runs.first().map_or("", |r| r.name.as_str())
        ),
    };
    let _ = write!(
        out,
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{}</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; max-width: 1140px; }}
h1 {{ font-size: 22px; }} h2 {{ font-size: 17px; margin-top: 28px; }}
p.note {{ color: #555; font-size: 13px; max-width: 1100px; }}
pre {{ font-size: 12px; background: #f6f6f6; padding: 12px; overflow-x: auto; }}
svg {{ display: block; background: #fff; }}
</style></head><body>
<h1>{}</h1>
"#,
        escape(&title),
        escape(&title)
    );
    let slo_ms = runs.first().map_or(0.0, |r| r.slo_ns as f64 / 1e6);
    let _ = writeln!(
        out,
        "<h2>TTFT distribution</h2>\n<p class=\"note\">Share of requests (y) whose time to first token is at most x; \
         the red line is the objective ({} ms).</p>",
        super::svg::label(slo_ms)
    );
    cdf(&mut out, runs);
    let _ = writeln!(
        out,
        "<h2>TTFT over time</h2>\n<p class=\"note\">Each request at its arrival; red: over the objective.</p>"
    );
    over_time(&mut out, runs);
    if let Some(a) = runs.first() {
        let _ = writeln!(
            out,
            "<h2>Slowest requests{}</h2>\n<p class=\"note\">Time since each request's arrival. Bars: waiting for \
             the GPU (queue), the GPU episode that produced the first token, and egress to the first token's \
             send; then the rest of the response. Below each bar, the kernel's evidence over the request: the run-queue \
             waits, the longest CPU-stage thread and the span of the large copies in the queue are amounts, drawn \
             from the arrival (the tracer keeps their totals, not their times); retransmits (&#x2715;) and the \
             client's ACK of the first token (black tick) are at their times.</p>",
            if runs.len() > 1 {
                format!(" of {}", escape(&a.name))
            } else {
                String::new()
            }
        );
        waterfall(&mut out, a);
    }
    let _ = write!(
        out,
        "<h2>Table</h2>\n<pre>{}</pre>\n</body></html>\n",
        escape(text)
    );
    out
}

fn open_svg(out: &mut String, id: &str, height: f64, what: &str) {
    let _ = write!(
        out,
        r#"<svg id="{id}" class="plot" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{}">"#,
        escape(what)
    );
}

/// Indices of at most [`MAX_POINTS`] of `n` items, evenly spread, the last
/// one included.
fn thinned(n: usize) -> impl Iterator<Item = usize> {
    let step = n.div_ceil(MAX_POINTS).max(1);
    (0..n)
        .step_by(step)
        .chain((n > 0 && !(n - 1).is_multiple_of(step)).then(|| n - 1))
}

fn legend(out: &mut String, runs: &[&Run], x: f64, y: f64) {
    if runs.len() < 2 {
        return;
    }
    for (i, r) in runs.iter().enumerate() {
        let yy = y + i as f64 * 16.0;
        let _ = write!(
            out,
            r#"<g class="legend"><rect x="{x}" y="{:.1}" width="14" height="4" fill="{}"/><text x="{:.1}" y="{:.1}" font-size="12">{}: {}</text></g>"#,
            yy - 4.0,
            COLOURS[i % 2],
            x + 20.0,
            yy + 1.0,
            ["A", "B"][i % 2],
            escape(&r.name)
        );
    }
}

/// The plotting area of a full-width chart `height` pixels tall, with room
/// for the y labels on the left and the x labels below.
fn plot_frame(height: f64) -> Frame {
    Frame {
        left: 70.0,
        top: 20.0,
        right: WIDTH - 20.0,
        bottom: height - 50.0,
    }
}

fn cdf(out: &mut String, runs: &[&Run]) {
    let height = 340.0;
    let f = plot_frame(height);
    let slo = runs.first().map_or(0, |r| r.slo_ns) as f64 / 1e6;
    let max = runs
        .iter()
        .filter_map(|r| r.ttft_sorted.last())
        .map(|&v| v as f64 / 1e6)
        .fold(slo, f64::max);
    let x = Scale::new((0.0, nice_max(max)), (f.left, f.right));
    let y = Scale::new((0.0, 1.0), (f.bottom, f.top));
    open_svg(out, "cdf", height, "TTFT cumulative distribution");
    axes(out, f, &x, Some(&y), "TTFT (ms)", "share of requests");
    for (i, r) in runs.iter().enumerate() {
        let n = r.ttft_sorted.len();
        if n == 0 {
            continue;
        }
        let mut d = format!(
            "M{:.1},{:.1}",
            x.at(r.ttft_sorted[0] as f64 / 1e6),
            y.at(0.0)
        );
        for k in thinned(n) {
            let _ = write!(
                d,
                " H{:.1} V{:.1}",
                x.at(r.ttft_sorted[k] as f64 / 1e6),
                y.at((k + 1) as f64 / n as f64)
            );
        }
        let _ = write!(
            out,
            r#"<path class="cdf" d="{d}" fill="none" stroke="{}" stroke-width="2"/>"#,
            COLOURS[i % 2]
        );
    }
    let px = x.at(slo);
    let _ = write!(
        out,
        r#"<line class="objective" x1="{px:.1}" y1="{:.1}" x2="{px:.1}" y2="{:.1}" stroke="{OVER}" stroke-width="2" stroke-dasharray="6,4"/>"#,
        f.top, f.bottom
    );
    let shares: Vec<String> = runs
        .iter()
        .enumerate()
        .filter_map(|(i, r)| {
            let s = r.within_slo()?;
            let who = if runs.len() > 1 {
                ["A ", "B "][i % 2]
            } else {
                ""
            };
            Some(format!("{who}{:.1}% within", s * 100.0))
        })
        .collect();
    let anchor = if px > f.right - 260.0 { "end" } else { "start" };
    let tx = if anchor == "end" { px - 6.0 } else { px + 6.0 };
    let _ = write!(
        out,
        r#"<text class="objective-label" x="{tx:.1}" y="{:.1}" font-size="13" fill="{OVER}" text-anchor="{anchor}">objective {} ms: {}</text>"#,
        f.bottom - 12.0,
        super::svg::label(slo),
        escape(&shares.join(", "))
    );
    // Top left: where a CDF has not risen yet.
    legend(out, runs, f.left + 16.0, f.top + 16.0);
    out.push_str("</svg>\n");
}

fn over_time(out: &mut String, runs: &[&Run]) {
    let height = 320.0;
    let f = plot_frame(height);
    let slo = runs.first().map_or(0, |r| r.slo_ns) as f64 / 1e6;
    let t_max = runs
        .iter()
        .filter_map(|r| r.points.last())
        .map(|p| p.t_s)
        .fold(0.0, f64::max);
    let y_max = runs
        .iter()
        .filter_map(|r| r.ttft_sorted.last())
        .map(|&v| v as f64 / 1e6)
        .fold(slo, f64::max);
    let x = Scale::new((0.0, nice_max(t_max)), (f.left, f.right));
    let y = Scale::new((0.0, nice_max(y_max)), (f.bottom, f.top));
    open_svg(
        out,
        "over-time",
        height,
        "TTFT of each request by its arrival",
    );
    axes(
        out,
        f,
        &x,
        Some(&y),
        "arrival (s since the first)",
        "TTFT (ms)",
    );
    let py = y.at(slo);
    let _ = write!(
        out,
        r#"<line class="objective" x1="{:.1}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="{OVER}" stroke-width="1.5" stroke-dasharray="6,4"/>"#,
        f.left, f.right
    );
    let _ = write!(
        out,
        r#"<text class="objective-label" x="{:.1}" y="{:.1}" font-size="12" fill="{OVER}" text-anchor="end">objective {} ms</text>"#,
        f.right - 6.0,
        py - 5.0,
        super::svg::label(slo)
    );
    for (i, r) in runs.iter().enumerate() {
        let _ = write!(out, r#"<g class="points" fill-opacity="0.75">"#);
        for k in thinned(r.points.len()) {
            let p = r.points[k];
            let v = p.ttft_ns as f64 / 1e6;
            let (fill, stroke) = if v > slo {
                (if runs.len() > 1 { COLOURS[i % 2] } else { OVER }, OVER)
            } else {
                (COLOURS[i % 2], "none")
            };
            let _ = write!(
                out,
                r#"<circle class="point" cx="{:.1}" cy="{:.1}" r="3.5" fill="{fill}" stroke="{stroke}"/>"#,
                x.at(p.t_s),
                y.at(v)
            );
        }
        out.push_str("</g>");
    }
    legend(out, runs, f.right - 300.0, f.top + 16.0);
    out.push_str("</svg>\n");
}

/// The far end of a request on the waterfall's axis, ms since its arrival.
fn reach_ms(r: &Request) -> f64 {
    let ttft = r.counted_ttft_ns().unwrap_or(0);
    let acked = r
        .t_first_token_acked_ns
        .map_or(0, |t| t.saturating_sub(r.t_arrive_ns));
    let retransmit = r
        .evidence
        .as_ref()
        .and_then(|e| e.retransmit_times_ns.last())
        .map_or(0, |t| t.saturating_sub(r.t_arrive_ns));
    ttft.max(acked).max(retransmit) as f64 / 1e6
}

const ROW: f64 = 50.0;
const LABELS: f64 = 290.0;

fn waterfall(out: &mut String, run: &Run) {
    let rows = run.slowest.len();
    let top = 46.0;
    let height = top + ROW * rows.max(1) as f64 + 50.0;
    let f = Frame {
        left: LABELS,
        top,
        right: WIDTH - 20.0,
        bottom: height - 50.0,
    };
    let max = run.slowest.iter().map(reach_ms).fold(0.0, f64::max);
    let x = Scale::new((0.0, nice_max(max)), (f.left, f.right));
    open_svg(
        out,
        "waterfall",
        height,
        "The slowest requests: where their time went",
    );
    axes(out, f, &x, None, "ms since the request's arrival", "");
    waterfall_legend(out);
    if rows == 0 {
        let _ = write!(
            out,
            r#"<text x="{:.1}" y="{:.1}" font-size="13">no request with a first token</text>"#,
            f.left + 10.0,
            f.top + 24.0
        );
    }
    for (i, r) in run.slowest.iter().enumerate() {
        request_row(out, run, &x, f.top + i as f64 * ROW, i + 1, r);
    }
    out.push_str("</svg>\n");
}

fn waterfall_legend(out: &mut String) {
    let items = [
        (QUEUE, "queue"),
        (GPU, "GPU"),
        (EGRESS, "egress"),
        (RESPONSE, "rest of the response"),
        (STALL, "stall"),
        (RUNQ, "run queue (total)"),
        (CPU_STAGE, "CPU stage, longest thread"),
        (COPIES, "large copies"),
    ];
    let mut x = 10.0;
    for ((class, colour), name) in items {
        let _ = write!(
            out,
            r#"<g class="legend"><rect class="{class}" x="{x:.1}" y="12" width="14" height="10" fill="{colour}"/><text x="{:.1}" y="21" font-size="12">{name}</text></g>"#,
            x + 18.0
        );
        x += 30.0 + 7.0 * name.len() as f64;
    }
    let _ = write!(
        out,
        r#"<g class="legend"><text x="{x:.1}" y="22" font-size="14" fill="{OVER}">&#x2715;</text><text x="{:.1}" y="21" font-size="12">retransmit</text></g>"#,
        x + 16.0
    );
}

/// Each cause with the time it explains, ms.
fn cause_list(causes: &[Cause]) -> Vec<String> {
    causes
        .iter()
        .map(|c| format!("{} {}", c.class, ms(c.explained_ns as f64)))
        .collect()
}

/// A stall after the first token on the response's lane, with its causes;
/// one past the axis is left out (the row's text counts it).
fn stall_mark(out: &mut String, x: &Scale, bar: f64, t_arrive_ns: u64, w: &StallWindow) {
    let from = w.t_start_ns.saturating_sub(t_arrive_ns) as f64 / 1e6;
    if x.at(from) >= x.at(f64::MAX) {
        return;
    }
    let causes = cause_list(&w.causes);
    let mut tip = format!(
        "stall {} ms: {}",
        ms(w.duration_ns as f64),
        if causes.is_empty() {
            "unexplained".to_string()
        } else {
            causes.join(", ")
        }
    );
    if let Some(other) = &w.interfering_request {
        let _ = write!(tip, " (request {} on {})", other.request_index, other.conn);
    }
    if w.seen_at == "delivery" {
        // Sent on time: the gap is between the chunks' ACKs.
        tip.push_str(" (seen at the delivery: between the ACKs of the chunks)");
    }
    let to = w.t_end_ns.saturating_sub(t_arrive_ns) as f64 / 1e6;
    rect(out, x, STALL, (from, to), (bar + 2.0, 12.0), &tip);
}

/// A bar from `span.0` to `span.1` ms on the lane `(y, height)`, with a tooltip.
fn rect(
    out: &mut String,
    x: &Scale,
    (class, colour): Mark,
    span: (f64, f64),
    (y, h): (f64, f64),
    tip: &str,
) {
    let (x0, x1) = (x.at(span.0), x.at(span.1));
    let _ = write!(
        out,
        r#"<rect class="{class}" x="{x0:.1}" y="{y:.1}" width="{:.1}" height="{h:.1}" fill="{colour}"><title>{}</title></rect>"#,
        (x1 - x0).max(1.0),
        escape(tip)
    );
}

fn request_row(out: &mut String, run: &Run, x: &Scale, y: f64, rank: usize, r: &Request) {
    let ttft = r.counted_ttft_ns().unwrap_or(0) as f64 / 1e6;
    let at = r.t_arrive_ns.saturating_sub(run.start_ns) as f64 / 1e9;
    let causes = cause_list(&r.causes);
    let mut causes = match (r.slow, causes.is_empty()) {
        (false, _) => "not judged slow".to_string(),
        (true, true) => "unexplained".to_string(),
        (true, false) => causes.join(", "),
    };
    let s = &r.stalls;
    if s.count > 0 {
        let _ = write!(
            causes,
            "; {} stall{}, longest {} ms",
            s.count,
            if s.count == 1 { "" } else { "s" },
            ms(s.longest_ns as f64)
        );
    }
    if s.degrading {
        causes.push_str("; degrading");
    }
    if s.chunks_growing {
        causes.push_str("; chunks growing");
    }
    if let Some(how) = &s.truncated {
        let _ = write!(causes, "; truncated ({how})");
    }
    let mut tip = format!(
        "#{rank}: {}:{} request {} on {}, {} {}",
        r.client_addr,
        r.client_port,
        r.request_index,
        r.conn,
        r.outcome,
        r.http_status.map_or_else(String::new, |s| s.to_string())
    );
    if let Some(e) = &r.evidence {
        for item in evidence_items(e) {
            let _ = write!(tip, "\n{item}");
        }
    }
    let _ = write!(
        out,
        r##"<g class="request"><title>{}</title><text x="10" y="{:.1}" font-size="12" font-weight="bold">#{rank} +{at:.2} s  TTFT {} ms</text><text x="10" y="{:.1}" font-size="11" fill="#555">{}</text>"##,
        escape(&tip),
        y + 18.0,
        ms(ttft * 1e6),
        y + 34.0,
        escape(&causes)
    );
    let bar = y + 8.0;
    match (r.queue_ns, r.gpu_ns, r.egress_ns) {
        (Some(q), Some(g), Some(e)) => {
            let (q, g, e) = (q as f64 / 1e6, g as f64 / 1e6, e as f64 / 1e6);
            rect(
                out,
                x,
                QUEUE,
                (0.0, q),
                (bar, 16.0),
                &format!("queue {q:.2} ms"),
            );
            rect(
                out,
                x,
                GPU,
                (q, q + g),
                (bar, 16.0),
                &format!("GPU {g:.2} ms"),
            );
            rect(
                out,
                x,
                EGRESS,
                (q + g, q + g + e),
                (bar, 16.0),
                &format!("egress {e:.2} ms"),
            );
        }
        _ => rect(
            out,
            x,
            NO_BREAKDOWN,
            (0.0, ttft),
            (bar, 16.0),
            "TTFT, no GPU episode joined",
        ),
    }
    if let Some(e2e) = r
        .e2e_ns
        .or(r.t_done_ns.map(|t| t.saturating_sub(r.t_arrive_ns)))
    {
        let e2e = e2e as f64 / 1e6;
        if e2e > ttft {
            let _ = write!(out, r#"<g opacity="0.3">"#);
            rect(
                out,
                x,
                RESPONSE,
                (ttft, e2e),
                (bar + 4.0, 8.0),
                &format!("response ends at {e2e:.2} ms"),
            );
            out.push_str("</g>");
        }
    }
    for w in &r.stalls.windows {
        stall_mark(out, x, bar, r.t_arrive_ns, w);
    }
    if let Some(acked) = r.t_first_token_acked_ns {
        let px = x.at(acked.saturating_sub(r.t_arrive_ns) as f64 / 1e6);
        let _ = write!(
            out,
            r##"<line class="ack" x1="{px:.1}" y1="{:.1}" x2="{px:.1}" y2="{:.1}" stroke="#000" stroke-width="1.5"><title>client ACK of the first token</title></line>"##,
            bar - 4.0,
            bar + 20.0
        );
    }
    if let Some(e) = &r.evidence {
        let lane = bar + 20.0;
        if e.runq_ns > 0 {
            let v = e.runq_ns as f64 / 1e6;
            rect(
                out,
                x,
                RUNQ,
                (0.0, v),
                (lane, 5.0),
                &format!(
                    "run queue, total {v:.2} ms (longest {:.2} ms)",
                    e.runq_max_ns as f64 / 1e6
                ),
            );
        }
        if e.cpu_stage_thread_max_ns > 0 {
            let v = e.cpu_stage_thread_max_ns as f64 / 1e6;
            rect(
                out,
                x,
                CPU_STAGE,
                (0.0, v),
                (lane + 6.0, 5.0),
                &format!("CPU stage, longest thread {v:.2} ms"),
            );
        }
        if e.large_copies > 0 {
            let span = e.large_copy_queue_span_ns as f64 / 1e6;
            let tip = format!(
                "{} large copies, {:.1} MiB; those in the queue span {span:.2} ms",
                e.large_copies,
                e.large_copy_bytes as f64 / f64::from(1 << 20)
            );
            rect(out, x, COPIES, (0.0, span), (lane + 12.0, 5.0), &tip);
        }
        for &t in &e.retransmit_times_ns {
            let px = x.at(t.saturating_sub(r.t_arrive_ns) as f64 / 1e6);
            let _ = write!(
                out,
                r#"<text class="retransmit" x="{px:.1}" y="{:.1}" font-size="14" text-anchor="middle" fill="{OVER}">&#x2715;<title>TCP retransmit</title></text>"#,
                bar + 13.0
            );
        }
    }
    out.push_str("</g>");
}
