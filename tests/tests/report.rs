//! `ttft-trace report` on a real demo run's JSONL (tests/report/demo-trace.jsonl:
//! `cargo xtask demo`'s target/demo/trace.jsonl, its episode lines left out), and
//! its HTML page rendered by a real headless browser (Debian's chromium, from
//! `cargo xtask setup`): the screenshot must show the plots drawn, in the
//! colours the page draws them with, in order. No root needed; without chromium
//! the browser test skips with the reason (fails with TTFT_TRACE_REQUIRE_FIXTURES).

use std::{
    fs,
    io::BufReader,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use ttft_trace_tests::{prometheus::require_tool, tracer::tracer_bin};

fn demo_trace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("report/demo-trace.jsonl")
}

fn scratch(test: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("ttft-report-{test}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Runs `ttft-trace report ARGS`; its stdout.
fn report(args: &[&Path], flags: &[&str]) -> Result<String> {
    let out = Command::new(tracer_bin()?)
        .arg("report")
        .args(args)
        .args(flags)
        .output()
        .context("running ttft-trace report")?;
    ensure!(
        out.status.success(),
        "ttft-trace report failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

#[test]
fn the_demo_run_is_reported_and_compared() -> Result<()> {
    let trace = demo_trace();
    let text = report(&[&trace], &[])?;
    eprintln!("{text}");
    let requests = fs::read_to_string(&trace)?
        .lines()
        .filter(|l| l.contains("\"type\":\"request\""))
        .count();
    ensure!(requests > 0, "the fixture has request lines");
    ensure!(
        text.contains(&format!(
            "Requests traced:                         {requests}\n"
        )),
        "{text}"
    );
    for want in [
        "Within objective (TTFT <= 350.00 ms):",
        "TTFT  ",
        "E2E   ",
        "Causes of slow requests",
        "#1 at +",
        "    evidence: ",
    ] {
        ensure!(text.contains(want), "missing {want:?}");
    }
    // Compared with itself: the same figures, no difference.
    let text = report(&[&trace], &["--compare", &trace.display().to_string()])?;
    ensure!(text.contains("ttft-trace report: comparison"), "{text}");
    ensure!(text.contains("TTFT P99"), "{text}");
    ensure!(
        text.contains("+0.00 (+0.0%)") && !text.contains("(-"),
        "a run against itself differs by nothing:\n{text}"
    );
    Ok(())
}

/// The colours html.rs draws each mark with.
const CDF_BLUE: [u8; 3] = [0x1f, 0x77, 0xb4];
const OBJECTIVE_RED: [u8; 3] = [0xd6, 0x27, 0x28];
const QUEUE: [u8; 3] = [0x9a, 0xa5, 0xb1];
const GPU: [u8; 3] = [0x2c, 0xa0, 0x2c];
const CPU_STAGE: [u8; 3] = [0x8c, 0x56, 0x4b];

#[test]
fn the_html_report_renders_in_a_headless_browser() -> Result<()> {
    let test = "the_html_report_renders_in_a_headless_browser";
    let Some(chromium) = require_tool("chromium", test) else {
        return Ok(());
    };
    let dir = scratch("browser")?;
    let html = dir.join("report.html");
    let png = dir.join("report.png");
    report(&[&demo_trace()], &["--html", &html.display().to_string()])?;
    let page = fs::read_to_string(&html)?;
    for element in [
        "<svg id=\"cdf\"",
        "<svg id=\"over-time\"",
        "<svg id=\"waterfall\"",
        "<path class=\"cdf\"",
        "<line class=\"objective\"",
        "<circle class=\"point\"",
        "<g class=\"request\"",
        "<rect class=\"queue\"",
        "<rect class=\"gpu\"",
        "<rect class=\"cpu-stage\"",
    ] {
        ensure!(page.contains(element), "the page lacks {element}");
    }
    ensure!(!page.contains("<script"), "no script");

    screenshot(&chromium, &dir, &html, &png)?;
    let shot = Screenshot::read(&png)?;
    eprintln!(
        "screenshot {}x{}: {:.1}% not white",
        shot.width,
        shot.height,
        shot.share_not_white() * 100.0
    );
    ensure!(shot.share_not_white() > 0.03, "the page is blank");
    // Each plot's marks are on screen, in the page's order: the CDF curve
    // and objective first, then the points, then the waterfall's bars.
    let mut rows = Vec::new();
    for (name, colour, at_least) in [
        ("CDF curve", CDF_BLUE, 300),
        ("objective", OBJECTIVE_RED, 150),
        ("queue bars", QUEUE, 3000),
        ("GPU bars", GPU, 1000),
        ("CPU-stage evidence", CPU_STAGE, 500),
    ] {
        let (n, first_row) = shot.count(colour);
        eprintln!("{name}: {n} pixels from row {first_row:?}");
        ensure!(
            n >= at_least,
            "{name}: {n} pixels of {colour:?}, want {at_least}"
        );
        rows.push((name, first_row.unwrap_or(0)));
    }
    ensure!(
        rows[0].1 < rows[2].1 && rows[1].1 < rows[2].1,
        "the CDF is above the waterfall: {rows:?}"
    );
    ensure!(
        rows[2].1 > shot.height / 4,
        "the waterfall is below the first two plots: {rows:?}"
    );
    let _ = fs::remove_dir_all(&dir);
    Ok(())
}

/// `chromium --headless --screenshot` of `html` into `png`, with a fresh
/// profile and nothing fetched; killed after a minute.
fn screenshot(chromium: &Path, dir: &Path, html: &Path, png: &Path) -> Result<()> {
    let profile = dir.join("profile");
    let mut child = Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--hide-scrollbars",
            "--window-size=1200,2000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(format!("--screenshot={}", png.display()))
        .arg(format!("file://{}", html.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting chromium")?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = child.try_wait()? {
            ensure!(status.success(), "chromium exited with {status}");
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("chromium took more than a minute");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    ensure!(png.is_file(), "chromium wrote no {}", png.display());
    Ok(())
}

struct Screenshot {
    width: usize,
    height: usize,
    /// RGB, row by row.
    rgb: Vec<[u8; 3]>,
}

impl Screenshot {
    fn read(path: &Path) -> Result<Self> {
        let mut decoder = png::Decoder::new(BufReader::new(fs::File::open(path)?));
        decoder.set_transformations(png::Transformations::normalize_to_color8());
        let mut reader = decoder.read_info()?;
        let size = reader.output_buffer_size().context("image too large")?;
        let mut buf = vec![0; size];
        let info = reader.next_frame(&mut buf)?;
        let samples = info.color_type.samples();
        ensure!(
            samples >= 3,
            "a colour screenshot, got {:?}",
            info.color_type
        );
        let (width, height) = (info.width as usize, info.height as usize);
        let rgb = buf[..info.line_size * height]
            .chunks(info.line_size)
            .flat_map(|line| line[..width * samples].chunks(samples))
            .map(|p| [p[0], p[1], p[2]])
            .collect();
        Ok(Self { width, height, rgb })
    }

    fn share_not_white(&self) -> f64 {
        let n = self
            .rgb
            .iter()
            .filter(|p| p.iter().any(|&c| c < 240))
            .count();
        n as f64 / self.rgb.len() as f64
    }

    /// Pixels of `colour` (within antialiasing's reach) and the first row
    /// holding one.
    fn count(&self, colour: [u8; 3]) -> (usize, Option<usize>) {
        let near = |p: &[u8; 3]| p.iter().zip(colour).all(|(&a, b)| a.abs_diff(b) <= 6);
        let mut n = 0;
        let mut first = None;
        for (i, p) in self.rgb.iter().enumerate() {
            if near(p) {
                n += 1;
                first.get_or_insert(i / self.width);
            }
        }
        (n, first)
    }
}
