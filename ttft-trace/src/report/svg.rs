//! What the plots are drawn with: linear scales, round ticks, axes, and
//! escaping. SVG as text; no script, no external resource.

use std::fmt::Write as _;

/// `s` safe inside HTML/SVG text and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Maps `[d0, d1]` linearly onto `[r0, r1]` (pixels).
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    pub d0: f64,
    pub d1: f64,
    pub r0: f64,
    pub r1: f64,
}

impl Scale {
    pub fn new(domain: (f64, f64), range: (f64, f64)) -> Self {
        // A flat domain (one value) still needs a width to divide by.
        let d1 = if domain.1 > domain.0 {
            domain.1
        } else {
            domain.0 + 1.0
        };
        Self {
            d0: domain.0,
            d1,
            r0: range.0,
            r1: range.1,
        }
    }

    pub fn at(&self, v: f64) -> f64 {
        let v = v.clamp(self.d0, self.d1);
        self.r0 + (v - self.d0) / (self.d1 - self.d0) * (self.r1 - self.r0)
    }
}

/// About `n` round ticks (1, 2 or 5 times a power of ten) over `[lo, hi]`.
pub fn ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    if hi <= lo || !lo.is_finite() || !hi.is_finite() {
        return vec![lo];
    }
    let raw = (hi - lo) / n.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * mag)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * mag);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step).floor() as i64;
    (first..=last).map(|i| i as f64 * step).collect()
}

/// An upper bound for an axis: a little above `max`, on a round tick.
pub fn nice_max(max: f64) -> f64 {
    if max <= 0.0 || !max.is_finite() {
        return 1.0;
    }
    let step = ticks(0.0, max * 1.05, 5)
        .windows(2)
        .map(|w| w[1] - w[0])
        .next()
        .unwrap_or(max);
    ((max * 1.05) / step).ceil() * step
}

/// A tick label without trailing zeros.
pub fn label(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The plot area of a figure, in pixels.
#[derive(Debug, Clone, Copy)]
pub struct Frame {
    pub left: f64,
    pub top: f64,
    pub right: f64,
    pub bottom: f64,
}

/// Axes with grid lines, tick labels and titles.
pub fn axes(
    out: &mut String,
    f: Frame,
    x: &Scale,
    y: Option<&Scale>,
    x_title: &str,
    y_title: &str,
) {
    let _ = write!(out, r##"<g class="axes" font-size="12" fill="#333">"##);
    for t in ticks(x.d0, x.d1, 8) {
        let px = x.at(t);
        let _ = write!(
            out,
            r##"<line x1="{px:.1}" y1="{:.1}" x2="{px:.1}" y2="{:.1}" stroke="#e3e3e3"/><text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            f.top,
            f.bottom,
            f.bottom + 16.0,
            label(t)
        );
    }
    if let Some(y) = y {
        for t in ticks(y.d0, y.d1, 5) {
            let py = y.at(t);
            let _ = write!(
                out,
                r##"<line x1="{:.1}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#e3e3e3"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                f.left,
                f.right,
                f.left - 6.0,
                py + 4.0,
                label(t)
            );
        }
    }
    let _ = write!(
        out,
        r##"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="none" stroke="#888"/><text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text><text transform="translate({:.1},{:.1}) rotate(-90)" text-anchor="middle">{}</text></g>"##,
        f.left,
        f.top,
        f.right - f.left,
        f.bottom - f.top,
        (f.left + f.right) / 2.0,
        f.bottom + 34.0,
        escape(x_title),
        f.left - 46.0,
        (f.top + f.bottom) / 2.0,
        escape(y_title)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 10.0, 5), [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(ticks(0.0, 1.0, 4), [0.0, 0.5, 1.0]);
        let t = ticks(0.0, 523.0, 8);
        assert_eq!(t.first(), Some(&0.0));
        assert_eq!(t[1], 100.0, "{t:?}");
        assert_eq!(ticks(3.0, 3.0, 5), [3.0], "a flat range");
        assert_eq!(nice_max(95.0), 100.0);
        assert!(nice_max(0.0) > 0.0);
    }

    #[test]
    fn scales_map_and_clamp() {
        let s = Scale::new((0.0, 100.0), (50.0, 250.0));
        assert_eq!(s.at(0.0), 50.0);
        assert_eq!(s.at(50.0), 150.0);
        assert_eq!(s.at(1000.0), 250.0, "clamped to the frame");
        let flat = Scale::new((5.0, 5.0), (0.0, 10.0));
        assert!(flat.at(5.0).is_finite());
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(
            escape("<a href=\"x\">&'"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
        assert_eq!(label(2.50), "2.5");
        assert_eq!(label(100.0), "100");
    }
}
