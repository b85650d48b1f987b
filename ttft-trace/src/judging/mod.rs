//! Judging: what a routed episode or finished request means. An episode
//! gets the GPU readings of its window; a request gets the evidence inside
//! its windows (its workload's signals, the GPU readings) and the causes
//! that evidence names, and its stalls after the first token, each judged on
//! its own window. One judged value each, for the sinks.

mod evidence;
mod prefills;
#[cfg(test)]
mod stall_tests;
mod stalls;

pub use stalls::{JudgedStall, JudgedStalls, Truncation};

use ttft_trace_common::{EpisodeEvent, signals::TCP_RETRANSMIT};

use crate::{
    causes::{Attribution, CauseConfig, Evidence, attribute},
    episodes::EpisodeRecord,
    host::clock::monotonic_ns,
    nvml::Sampler,
    requests::{EpisodeHistory, RequestRecord, stream_stalls::StallConfig},
    routing::Workload,
    signals::SignalStore,
};

/// A finished request with its evidence and attribution.
pub struct JudgedRequest {
    pub record: RequestRecord,
    pub evidence: Evidence,
    pub attribution: Attribution,
    /// TCP retransmits on the request's connection between its arrival and
    /// its last send, or the first token's delivery (its ACK, or the end of
    /// the wait for it) when that is later (every request, slow or not).
    pub tcp_retransmits: usize,
    /// Its stalls after the first token, each judged, and its pace.
    pub stalls: JudgedStalls,
}

/// What a workload gives the judge of a request: its signals, and its
/// correlator's recent GPU episodes (`None`: not known).
pub struct WorkloadSignals<'a> {
    pub root: u32,
    pub store: &'a SignalStore,
    pub(crate) episodes: Option<&'a EpisodeHistory>,
}

impl<'a> WorkloadSignals<'a> {
    /// What workload `w` gives: its signals and its recent GPU episodes.
    pub fn of(w: &'a Workload) -> Self {
        Self {
            root: w.root,
            store: &w.signals,
            episodes: Some(w.correlator.episodes()),
        }
    }
}

pub struct Judge {
    causes: CauseConfig,
    stall_config: StallConfig,
    /// Recent requests' prefill windows per workload, for stalls.
    prefills: prefills::Prefills,
    /// Stall windows found beyond the listed ones (not judged), since the
    /// start.
    pub stall_windows_dropped: u64,
    /// GPU readings; None without NVML.
    gpu: Option<Sampler>,
    /// When tracing began (a process started before it has no known first
    /// episode).
    traced_since_ns: u64,
}

impl Judge {
    pub fn new(causes: CauseConfig, stall_config: StallConfig, gpu: Option<Sampler>) -> Self {
        Self {
            causes,
            stall_config,
            prefills: prefills::Prefills::default(),
            stall_windows_dropped: 0,
            gpu,
            traced_since_ns: monotonic_ns(),
        }
    }

    /// The episode as reported, with its GPU's readings over
    /// [first launch, D2H done].
    pub fn episode(&self, ev: &EpisodeEvent) -> EpisodeRecord {
        let mut rec = EpisodeRecord::new(ev);
        if let Some(gpu) = &self.gpu {
            rec.gpu = gpu.window(
                gpu.gpu_of_pid(ev.tgid),
                ev.t_first_launch_ns,
                ev.t_copy_done_ns,
            );
        }
        rec
    }

    /// Prefill windows evicted from the per-workload rings, since the start.
    pub fn prefill_windows_evicted(&self) -> u64 {
        self.prefills.evicted
    }

    /// Forgets an ended workload's prefill windows.
    /// Workloads whose prefill windows are kept.
    pub fn prefill_workloads(&self) -> usize {
        self.prefills.workloads()
    }

    pub fn forget_workload(&mut self, root: u32) {
        self.prefills.forget(root);
    }

    /// Evidence and causes of a finished request of the workload whose
    /// signals are `w`, and its stalls, judged against the prefills of the
    /// requests judged before it (then its own is kept for those after);
    /// `now_ns` ends a response that has not.
    pub fn request(
        &mut self,
        record: RequestRecord,
        w: &WorkloadSignals,
        now_ns: u64,
    ) -> JudgedRequest {
        let signals = w.store;
        let stalls = stalls::judge(
            &record,
            w,
            self.gpu.as_ref(),
            &self.prefills,
            &self.stall_config,
            &self.causes,
        );
        self.stall_windows_dropped += u64::from(stalls.windows_dropped);
        self.prefills.insert(w.root, &record, now_ns);
        let evidence = evidence::gather(&record, signals, self.gpu.as_ref(), self.traced_since_ns);
        let attribution = attribute(&evidence, &self.causes);
        // Arrival to the response's end, or to the first token's delivery
        // when that came later (a lost segment of a stream sent with Nagle
        // on is retransmitted after the last send): never fewer than the
        // `network` cause names.
        let end = record.t_done_ns.unwrap_or(now_ns);
        let end = evidence
            .request
            .t_delivered_ns()
            .map_or(end, |d| d.max(end));
        let tcp_retransmits = signals
            .tcp_events_in(record.sk, record.t_arrive_ns, end)
            .filter(|e| e.what == TCP_RETRANSMIT)
            .count();
        JudgedRequest {
            record,
            evidence,
            attribution,
            tcp_retransmits,
            stalls,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        causes::CauseConfig,
        report::tests::{MS, T0, record},
        requests::Outcome,
    };
    use ttft_trace_common::signals::{EVENT_TCP, TCP_RESET_SENT, TcpEvent};

    fn tcp(what: u32, sk: u64, t_ns: u64) -> TcpEvent {
        TcpEvent {
            kind: EVENT_TCP,
            what,
            sk,
            t_ns,
        }
    }

    /// Retransmits counted from the arrival to the response's end, or to the
    /// first token's delivery when that came later; not other connections'
    /// nor resets.
    #[test]
    fn retransmits_cover_the_first_tokens_delivery() {
        let mut judge = Judge::new(CauseConfig::default(), StallConfig::default(), None);
        let mut signals = SignalStore::default();
        let rec = record(Outcome::Ok);
        let sk = rec.sk;
        for ev in [
            tcp(TCP_RETRANSMIT, sk, T0 - MS),
            tcp(TCP_RETRANSMIT, sk, T0 + 20 * MS),
            tcp(TCP_RETRANSMIT, sk, T0 + 200 * MS),
            tcp(TCP_RETRANSMIT, sk, T0 + 900 * MS),
            tcp(TCP_RESET_SENT, sk, T0 + 25 * MS),
            tcp(TCP_RETRANSMIT, sk + 1, T0 + 20 * MS),
        ] {
            signals.on_tcp(&ev);
        }
        let signals = WorkloadSignals {
            root: 1,
            store: &signals,
            episodes: None,
        };
        // Done at 30 ms, first token unacknowledged.
        assert_eq!(judge.request(rec.clone(), &signals, T0).tcp_retransmits, 1);
        // The first token acknowledged at 500 ms, after the last send.
        let acked = RequestRecord {
            t_first_token_acked_ns: Some(T0 + 500 * MS),
            ..rec.clone()
        };
        assert_eq!(judge.request(acked, &signals, T0).tcp_retransmits, 2);
        // Never acknowledged: the wait for it (first token + 5 s) counts.
        let unacked = RequestRecord {
            t_first_token_unacked_ns: Some(T0 + 5_010 * MS),
            ..rec
        };
        assert_eq!(judge.request(unacked, &signals, T0).tcp_retransmits, 3);
    }
}
