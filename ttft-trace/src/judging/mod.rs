//! Judging: what a routed episode or finished request means. An episode
//! gets the GPU readings of its window; a request gets the evidence inside
//! its windows (its workload's signals, the GPU readings) and the causes
//! that evidence names. One judged value each, for the sinks.

mod evidence;

use ttft_trace_common::{EpisodeEvent, signals::TCP_RETRANSMIT};

use crate::{
    causes::{Attribution, CauseConfig, Evidence, attribute},
    clock::monotonic_ns,
    episodes::EpisodeRecord,
    nvml::Sampler,
    requests::RequestRecord,
    signals::SignalStore,
};

/// A finished request with its evidence and attribution.
pub struct JudgedRequest {
    pub record: RequestRecord,
    pub evidence: Evidence,
    pub attribution: Attribution,
    /// TCP retransmits on the request's connection between its arrival and
    /// its last send (every request, slow or not).
    pub tcp_retransmits: usize,
}

pub struct Judge {
    causes: CauseConfig,
    /// GPU readings; None without NVML.
    gpu: Option<Sampler>,
    /// When tracing began (a process started before it has no known first
    /// episode).
    traced_since_ns: u64,
}

impl Judge {
    pub fn new(causes: CauseConfig, gpu: Option<Sampler>) -> Self {
        Self {
            causes,
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

    /// Evidence and causes of a finished request of the workload whose
    /// signals are `signals`; `now_ns` ends a response that has not.
    pub fn request(
        &self,
        record: RequestRecord,
        signals: &SignalStore,
        now_ns: u64,
    ) -> JudgedRequest {
        let evidence = evidence::gather(&record, signals, self.gpu.as_ref(), self.traced_since_ns);
        let attribution = attribute(&evidence, &self.causes);
        let end = record.t_done_ns.unwrap_or(now_ns);
        let tcp_retransmits = signals
            .tcp_events_in(record.sk, record.t_arrive_ns, end)
            .filter(|e| e.what == TCP_RETRANSMIT)
            .count();
        JudgedRequest {
            record,
            evidence,
            attribution,
            tcp_retransmits,
        }
    }
}
