//! Episodes as userspace reports them: the kernel's record plus names, for
//! the JSONL log and the summary.

use serde::Serialize;

use crate::nvml::WindowReadings;
use ttft_trace_common::{API_DRIVER, API_RUNTIME, Completion, EpisodeEvent};

/// One JSONL line per episode. Times are CLOCK_MONOTONIC nanoseconds, the
/// clock of `bpf_ktime_get_ns`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct EpisodeRecord {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub pid: u32,
    pub tid: u32,
    /// `runtime`, `driver` or `runtime+driver`: which API launched the work.
    pub api: &'static str,
    pub stream: String,
    pub copy_stream: String,
    pub kernel_launches: u32,
    pub graph_launches: u32,
    pub t_first_launch_ns: u64,
    pub t_copy_enqueue_ns: u64,
    pub t_copy_done_ns: u64,
    /// `t_copy_done_ns - t_first_launch_ns`.
    pub launch_to_first_d2h_ns: u64,
    pub copy_bytes: u64,
    /// What completed the copy: sync_copy, stream_sync, event_sync,
    /// device_sync or context_sync.
    pub completion: &'static str,
    /// Return value of the completing call (0 = success).
    pub status: i32,
    /// NVML readings of the episode's GPU over [first launch, D2H done]
    /// (absent without NVML).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<WindowReadings>,
}

impl EpisodeRecord {
    pub fn new(ev: &EpisodeEvent) -> Self {
        Self {
            kind: "episode",
            pid: ev.tgid,
            tid: ev.tid,
            api: api_name(ev.api),
            stream: format!("{:#x}", ev.stream),
            copy_stream: format!("{:#x}", ev.copy_stream),
            kernel_launches: ev.kernel_launches,
            graph_launches: ev.graph_launches,
            t_first_launch_ns: ev.t_first_launch_ns,
            t_copy_enqueue_ns: ev.t_copy_enqueue_ns,
            t_copy_done_ns: ev.t_copy_done_ns,
            launch_to_first_d2h_ns: ev.latency_ns(),
            copy_bytes: ev.copy_bytes,
            completion: Completion::from_u32(ev.completion).map_or("unknown", Completion::name),
            status: ev.status,
            gpu: None,
        }
    }

    /// Whether the completing call succeeded.
    pub fn ok(&self) -> bool {
        self.status == 0
    }
}

fn api_name(api: u32) -> &'static str {
    match (api & API_RUNTIME != 0, api & API_DRIVER != 0) {
        (true, true) => "runtime+driver",
        (true, false) => "runtime",
        (false, true) => "driver",
        (false, false) => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ttft_trace_common::EVENT_EPISODE;

    #[test]
    fn record_from_event() {
        let ev = EpisodeEvent {
            kind: EVENT_EPISODE,
            tgid: 5,
            tid: 6,
            completion: Completion::EventSync as u32,
            api: API_RUNTIME | API_DRIVER,
            status: 0,
            kernel_launches: 3,
            graph_launches: 0,
            stream: 0x20,
            copy_stream: 0,
            t_first_launch_ns: 100,
            t_copy_enqueue_ns: 150,
            t_copy_done_ns: 400,
            copy_bytes: 8,
        };
        let r = EpisodeRecord::new(&ev);
        assert_eq!(r.launch_to_first_d2h_ns, 300);
        assert_eq!(
            (r.api, r.completion, r.stream.as_str()),
            ("runtime+driver", "event_sync", "0x20")
        );
        assert!(r.ok());
        let json = serde_json::to_string(&r).expect("serialise");
        assert!(
            json.starts_with("{\"type\":\"episode\",\"pid\":5,"),
            "{json}"
        );
        assert_eq!(api_name(0), "unknown");
        let bad = EpisodeEvent {
            completion: 42,
            ..ev
        };
        assert_eq!(EpisodeRecord::new(&bad).completion, "unknown");
    }
}
