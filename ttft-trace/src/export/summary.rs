//! How the terminal summary reads: a line per interval, a block at the end.

use std::fmt::Write as _;

use ttft_trace_common::{Direction, GpuCounters};

use crate::record::Percentiles;

/// Milliseconds with precision that suits the size.
pub fn ms(ns: u64) -> String {
    let ms = ns as f64 / 1e6;
    if ms >= 100.0 {
        format!("{ms:.0}ms")
    } else if ms >= 1.0 {
        format!("{ms:.2}ms")
    } else {
        format!("{ms:.3}ms")
    }
}

pub fn percentiles(p: &Percentiles) -> String {
    if p.count == 0 {
        return "-".into();
    }
    format!(
        "p50 {} p95 {} p99 {} p99.9 {} max {}",
        ms(p.p50),
        ms(p.p95),
        ms(p.p99),
        ms(p.p999),
        ms(p.max)
    )
}

/// One line per summary interval.
pub fn interval_line(
    elapsed_s: f64,
    window: &Percentiles,
    errors: u64,
    totals: &GpuCounters,
    lost: u64,
) -> String {
    format!(
        "[{elapsed_s:7.1}s] episodes +{} (failed +{errors}) | launch->first D2H {} | launches {} graphs {} | lost {lost}",
        window.count,
        percentiles(window),
        totals.kernel_launches,
        totals.graph_launches,
    )
}

fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// The block printed when tracing ends.
pub fn final_block(
    title: &str,
    elapsed_s: f64,
    total: &Percentiles,
    failed: u64,
    totals: &GpuCounters,
    lost: u64,
) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "== ttft-trace: {title}, {elapsed_s:.1} s ==");
    let _ = writeln!(
        s,
        "GPU episodes:        {} ok, {failed} failed (completing call returned an error)",
        total.count
    );
    let _ = writeln!(s, "launch->first D2H:   {}", percentiles(total));
    let _ = writeln!(
        s,
        "launches:            {} kernel, {} graph",
        totals.kernel_launches, totals.graph_launches
    );
    let mut copies = Vec::new();
    for dir in Direction::ALL {
        let i = dir as usize;
        if totals.memcpy_calls[i] > 0 {
            copies.push(format!(
                "{} {} in {} calls",
                dir.name(),
                bytes(totals.memcpy_bytes[i]),
                totals.memcpy_calls[i]
            ));
        }
    }
    let copies = if copies.is_empty() {
        "none".to_string()
    } else {
        copies.join(", ")
    };
    let _ = writeln!(s, "memory copies:       {copies}");
    let _ = write!(s, "events lost:         {lost}");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(ms(1_234_567), "1.23ms");
        assert_eq!(ms(250_000), "0.250ms");
        assert_eq!(ms(350_000_000), "350ms");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(4096), "4.0 KiB");
        assert_eq!(percentiles(&Percentiles::default()), "-");
        let mut t = GpuCounters {
            kernel_launches: 8,
            ..GpuCounters::default()
        };
        t.memcpy_calls[2] = 2;
        t.memcpy_bytes[2] = 8192;
        let p = Percentiles {
            count: 2,
            p50: 1_000_000,
            p95: 2_000_000,
            p99: 2_000_000,
            p999: 2_000_000,
            max: 2_000_000,
        };
        let block = final_block("pid 1 (x)", 1.0, &p, 0, &t, 0);
        assert!(block.contains("2 ok, 0 failed"), "{block}");
        assert!(block.contains("d2h 8.0 KiB in 2 calls"), "{block}");
        assert!(block.contains("p50 1.00ms"), "{block}");
        let line = interval_line(5.0, &p, 0, &t, 0);
        assert!(line.contains("episodes +2"), "{line}");
    }
}
