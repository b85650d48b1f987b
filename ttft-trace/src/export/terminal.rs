//! The terminal summary: exact percentiles of GPU episodes and request
//! figures and the cause mix, a block of lines per interval and one at the
//! end. A closed or broken stdout ends the summary quietly, never tracing.

use std::io::Write;

use ttft_trace_common::GpuCounters;

use super::summary;
use crate::{
    causes::CauseSummary, episodes::EpisodeRecord, judging::JudgedRequest, record::LatencyRecorder,
    requests::RequestRecorders,
};

pub struct Terminal {
    /// Launch-to-first-D2H of successful episodes.
    latency: LatencyRecorder,
    failed_total: u64,
    failed_window: u64,
    request_figures: RequestRecorders,
    causes: CauseSummary,
    pub requests_total: u64,
}

impl Default for Terminal {
    fn default() -> Self {
        Self {
            latency: LatencyRecorder::new(),
            failed_total: 0,
            failed_window: 0,
            request_figures: RequestRecorders::new(),
            causes: CauseSummary::new(5),
            requests_total: 0,
        }
    }
}

/// Prints `lines`; a failed write (stdout closed) is ignored.
fn print(lines: &[String]) {
    let mut out = std::io::stdout().lock();
    for line in lines {
        if writeln!(out, "{line}").is_err() {
            return;
        }
    }
    let _ = out.flush();
}

impl Terminal {
    pub fn episode(&mut self, rec: &EpisodeRecord) {
        if rec.ok() {
            self.latency.record(rec.launch_to_first_d2h_ns);
        } else {
            self.failed_total += 1;
            self.failed_window += 1;
        }
    }

    pub fn request(&mut self, j: &JudgedRequest) {
        self.requests_total += 1;
        self.request_figures.record(&j.record);
        let r = &j.record;
        self.causes.record(&j.attribution, || {
            format!("{}:{} #{}", r.client_addr, r.client_port, r.request_index)
        });
    }

    /// Successful and failed episodes so far.
    pub fn episodes(&self) -> (u64, u64) {
        (self.latency.total().count, self.failed_total)
    }

    /// The lines of the interval that ends now (and starts the next).
    pub fn interval(&mut self, elapsed_s: f64, totals: &GpuCounters, lost: u64) {
        let window = self.latency.take_window();
        let mut lines = vec![summary::interval_line(
            elapsed_s,
            &window,
            self.failed_window,
            totals,
            lost,
        )];
        self.failed_window = 0;
        lines.extend(
            self.request_figures
                .window_lines(summary::percentiles)
                .into_iter()
                .filter(|l| !l.contains(" n=0 "))
                .chain(self.causes.window_lines())
                .map(|l| format!("           {l}")),
        );
        print(&lines);
    }

    /// The block printed when tracing ends.
    pub fn finish(&self, title: &str, elapsed_s: f64, totals: &GpuCounters, lost: u64) {
        let mut lines = vec![summary::final_block(
            title,
            elapsed_s,
            &self.latency.total(),
            self.failed_total,
            totals,
            lost,
        )];
        if self.requests_total > 0 {
            lines.push(format!("requests:            {}", self.requests_total));
            lines.extend(
                self.request_figures
                    .total_lines(summary::percentiles)
                    .into_iter()
                    .map(|l| format!("  {l}")),
            );
            lines.extend(self.causes.total_lines());
        }
        print(&lines);
    }
}
