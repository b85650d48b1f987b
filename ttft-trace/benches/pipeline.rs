//! Userspace cost per ring-buffer event: decode, episode record, JSONL
//! serialisation, exact percentiles and the Prometheus histogram, i.e. what
//! the event loop does for each episode. Prints one JSON line.
//! Run: `cargo bench -p ttft-trace --bench pipeline` (or `cargo xtask bench`).

use std::{hint::black_box, time::Instant};

use ttft_trace::{
    decode::{Event, decode, encode},
    episodes::EpisodeRecord,
    export::prometheus::Metrics,
    record::LatencyRecorder,
};
use ttft_trace_common::{EVENT_EPISODE, EpisodeEvent};

const EVENTS: u64 = 1_000_000;

fn main() -> anyhow::Result<()> {
    let metrics = Metrics::new(&ttft_trace::workloads::labels::LABEL_NAMES)?;
    // A workload's labels as the daemon would set them.
    let workload = ["python3", "4f1c3c2a9e8b", "vllm-0", "serving"];
    metrics.init_workload(&workload);
    let mut latency = LatencyRecorder::new();
    let records: Vec<Vec<u8>> = (0..1024u64)
        .map(|i| {
            encode(&EpisodeEvent {
                kind: EVENT_EPISODE,
                tgid: 100,
                tid: 101,
                completion: 2,
                api: 1,
                kernel_launches: 8,
                stream: 0x5555_0000 + i,
                t_first_launch_ns: 1_000_000 * i,
                t_copy_enqueue_ns: 1_000_000 * i + 500_000,
                t_copy_done_ns: 1_000_000 * i + 700_000 + i * 1000,
                copy_bytes: 4096,
                ..EpisodeEvent::default()
            })
        })
        .collect();
    let mut out = Vec::with_capacity(1 << 20);
    let start = Instant::now();
    for i in 0..EVENTS {
        let bytes = &records[(i % 1024) as usize];
        if let Ok(Event::Episode(ev)) = decode(bytes) {
            let rec = EpisodeRecord::new(&ev);
            metrics.observe_episode(&rec, &workload);
            latency.record(rec.launch_to_first_d2h_ns);
            serde_json::to_writer(&mut out, &rec)?;
            out.push(b'\n');
            if out.len() > (1 << 20) {
                black_box(&out);
                out.clear();
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{{\"bench\":\"userspace_episode_pipeline\",\"events\":{EVENTS},\"seconds\":{secs:.3},\"events_per_s\":{:.0},\"ns_per_event\":{:.0}}}",
        EVENTS as f64 / secs,
        secs * 1e9 / EVENTS as f64
    );
    Ok(())
}
