//! The traced arrival and first token of each request against the server's
//! own stamps of them (issue 27, item 2): the server (the demo, a stack's
//! app) reads CLOCK_MONOTONIC, the clock of `bpf_ktime_get_ns`, right after
//! the read that returned the request's first bytes (or where its stack
//! first shows it the request) and right before the send (or the hand-off to
//! its stack) of the first token. The tracer's arrival is dated inside that
//! read (`tcp_rcv_space_adjust`) and its first token at the send's start
//! (`tcp_sendmsg_locked`), so per request
//! `0 ≤ read stamp − traced arrival ≤ arrival tolerance` and
//! `0 ≤ traced first token − send stamp ≤ first-token tolerance`.

use std::{borrow::Borrow, collections::HashMap, path::Path};

use anyhow::Result;
use serde::Deserialize;
use serde_json::Value;

use crate::demo::read_jsonl;

/// One request as the server's own clock saw it.
#[derive(Debug, Clone, Copy)]
pub struct Stamps {
    /// The client's port and the request's index on its connection (from 1).
    pub key: (u64, u64),
    /// Just after the read that returned the request's first bytes.
    pub read_ns: u64,
    /// Just before the send of the first token.
    pub send_ns: u64,
}

/// The stamps an app logged (tests/stacks: `gpu.stamp`, mhd.c, axum), one
/// JSON line `{"client_port", "request_index"?, "t_read", "t_send"}` per
/// request; none when it logged none. A line without `request_index` (the
/// app does not know it) is numbered by its `t_read` among its port's: the
/// requests on a connection come one after another.
pub fn app_stamps(path: &Path) -> Result<Vec<Stamps>> {
    #[derive(Deserialize)]
    struct Line {
        client_port: u64,
        request_index: Option<u64>,
        t_read: u64,
        t_send: u64,
    }
    if !path.exists() {
        return Ok(Vec::new());
    }
    let mut lines = read_jsonl::<Line>(path)?;
    lines.sort_by_key(|l| (l.client_port, l.t_read));
    let mut numbered: HashMap<u64, u64> = HashMap::new();
    Ok(lines
        .into_iter()
        .map(|l| {
            let n = numbered.entry(l.client_port).or_insert(0);
            *n += 1;
            Stamps {
                key: (l.client_port, l.request_index.unwrap_or(*n)),
                read_ns: l.t_read,
                send_ns: l.t_send,
            }
        })
        .collect())
}

/// The bounds one server is held to, in ms.
#[derive(Debug, Clone, Copy)]
pub struct Tolerance {
    /// Per request.
    pub arrival_ms: f64,
    pub first_token_ms: f64,
    /// The median of each deviation: a shift of every request (a clock or
    /// hook off by a fixed amount) shows there long before the bound of one
    /// request.
    pub median_ms: f64,
}

/// Per-request deviations of one run, in ms, and the requests out of bounds.
#[derive(Debug, Default)]
pub struct Deviations {
    /// Read stamp − traced arrival.
    pub arrival: Vec<f64>,
    /// Traced first token − send stamp.
    pub first_token: Vec<f64>,
    pub problems: Vec<String>,
}

/// A traced request's key: its client port and its index on the connection
/// from 1 (the JSONL's `request_index` counts from 0).
pub fn request_key(r: &Value) -> (u64, u64) {
    (
        r["client_port"].as_u64().unwrap_or(0),
        r["request_index"].as_u64().unwrap_or(0) + 1,
    )
}

/// The `q` quantile (nearest rank) of `v`; 0 when empty.
pub fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 - 1.0) * q).round() as usize]
}

impl Deviations {
    /// Compares every stamped request with the traced one of the same key
    /// (client port, request index from 1); a stamped request not traced,
    /// or traced without an arrival or first token, is a problem.
    pub fn judge<V: Borrow<Value>>(
        stamps: &[Stamps],
        traced: &HashMap<(u64, u64), V>,
        tol: Tolerance,
    ) -> Self {
        let mut d = Self::default();
        for s in stamps {
            let Some(t) = traced.get(&s.key).map(Borrow::borrow) else {
                d.problems
                    .push(format!("stamped request {:?} not in the trace", s.key));
                continue;
            };
            let (Some(arrive), Some(token)) =
                (t["t_arrive_ns"].as_u64(), t["t_first_token_ns"].as_u64())
            else {
                d.problems
                    .push(format!("no traced arrival or first token: {t}"));
                continue;
            };
            let arrival = (s.read_ns as f64 - arrive as f64) / 1e6;
            let first_token = (token as f64 - s.send_ns as f64) / 1e6;
            if !(0.0..=tol.arrival_ms).contains(&arrival) {
                d.problems.push(format!(
                    "read stamp − traced arrival {arrival:.3} ms, not in [0, {}] ms (stamp {}): {t}",
                    tol.arrival_ms, s.read_ns
                ));
            }
            if !(0.0..=tol.first_token_ms).contains(&first_token) {
                d.problems.push(format!(
                    "traced first token − send stamp {first_token:.3} ms, not in [0, {}] ms \
                     (stamp {}): {t}",
                    tol.first_token_ms, s.send_ns
                ));
            }
            d.arrival.push(arrival);
            d.first_token.push(first_token);
        }
        for (what, v) in [
            ("read stamp − traced arrival", &d.arrival),
            ("traced first token − send stamp", &d.first_token),
        ] {
            let median = percentile(v, 0.5);
            if median > tol.median_ms {
                d.problems.push(format!(
                    "{what}: median {median:.3} ms over {} ms",
                    tol.median_ms
                ));
            }
        }
        d
    }

    /// P50 / P99 / max of both deviations.
    pub fn summary(&self) -> String {
        let max = |v: &[f64]| v.iter().copied().fold(f64::MIN, f64::max);
        format!(
            "{} requests: read stamp − traced arrival P50 {:.3} / P99 {:.3} / max {:.3} ms; \
             traced first token − send stamp P50 {:.3} / P99 {:.3} / max {:.3} ms",
            self.arrival.len(),
            percentile(&self.arrival, 0.5),
            percentile(&self.arrival, 0.99),
            max(&self.arrival),
            percentile(&self.first_token, 0.5),
            percentile(&self.first_token, 0.99),
            max(&self.first_token),
        )
    }
}
