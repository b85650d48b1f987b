//! Routing: each ring-buffer record decoded and handed to its workload's
//! request correlator and signal store. What comes out (GPU episodes,
//! finished requests, processes the kernel announced, host-wide TCP events)
//! is queued as [`Routed`] values for the judge and the sinks. No I/O.

mod workloads;

use ttft_trace_common::{CONN_OPEN, EpisodeEvent, signals::SchedEvent};

pub use workloads::{Unbound, Workload, Workloads};

use crate::{
    decode::{Event, decode},
    requests::{self, CorrelatorConfig, CorrelatorStats, RequestRecord},
};

/// What routing hands on, in the order it happened.
#[derive(Debug)]
pub enum Routed {
    /// A GPU episode of workload `root`.
    Episode { root: u32, event: EpisodeEvent },
    /// A finished request of workload `root` (boxed: a record is large).
    Request {
        root: u32,
        record: Box<RequestRecord>,
    },
    /// An untraced process called into a probed library (daemon mode).
    Announced(u32),
    /// A TCP retransmit or reset somewhere on the host (a host-wide count).
    Tcp { what: u32 },
}

#[derive(Default)]
pub struct Router {
    pub workloads: Workloads,
    /// The settings of each new workload's correlator.
    pub correlator: CorrelatorConfig,
    out: Vec<Routed>,
    /// Records that could not be decoded.
    pub decode_errors: u64,
}

impl Router {
    /// A router whose new workloads' correlators take `correlator`.
    pub fn new(correlator: CorrelatorConfig) -> Self {
        Self {
            correlator,
            ..Self::default()
        }
    }

    /// Routes one ring-buffer record. `lookup` asks the kernel for the
    /// workload of a process not seen before.
    pub fn route(&mut self, bytes: &[u8], lookup: impl Fn(u32) -> Option<u32>) {
        let ws = &mut self.workloads;
        match decode(bytes) {
            Ok(Event::Conn(ev)) if ev.op == CONN_OPEN => ws.hold_open(&ev),
            Ok(Event::Conn(ev)) => {
                // Followed past its close, until the kernel is done with it.
                if let Some(w) = ws.of_socket(ev.sk, requests::ends_socket(&ev)) {
                    w.correlator.on_conn(&ev);
                }
            }
            Ok(Event::Sock(ev)) => {
                let Some(root) = ws.of_process(ev.tgid, lookup).map(|w| w.root) else {
                    return;
                };
                let held = ws.bind_socket(ev.sk, root);
                if let Some(w) = ws.of_socket(ev.sk, false) {
                    if let Some(held) = held {
                        if let Some(open) = held.open {
                            w.correlator.on_conn(&open);
                        }
                        for seg in &held.segments {
                            w.correlator.on_segment(seg);
                        }
                        for frames in held.h2 {
                            w.correlator.on_h2(frames);
                        }
                    }
                    w.correlator.on_sock(&ev);
                }
            }
            Ok(Event::Segment(ev)) => {
                if let Some(w) = ws.route_segment(&ev) {
                    w.correlator.on_segment(&ev);
                }
            }
            Ok(Event::H2(ev)) => {
                if let Some((w, ev)) = ws.route_h2(ev) {
                    w.correlator.on_h2(ev);
                }
            }
            // A server's send: its socket was bound by the send's own
            // event, which came first.
            Ok(Event::H2Block(ev)) => match ws.of_socket(ev.sk, false) {
                Some(w) => w.correlator.on_h2_block(ev),
                None => ws.unrouted += 1,
            },
            Ok(Event::Sched(ev)) => self.route_sched(&ev, lookup),
            Ok(Event::Tcp(ev)) => {
                self.out.push(Routed::Tcp { what: ev.what });
                if let Some(w) = ws.of_socket(ev.sk, false) {
                    w.signals.on_tcp(&ev);
                }
            }
            Ok(Event::Copy(ev)) => {
                if let Some(w) = ws.of_process(ev.tgid, lookup) {
                    w.signals.on_copy(&ev);
                }
            }
            Ok(Event::Discover(ev)) => self.out.push(Routed::Announced(ev.tgid)),
            Ok(Event::Episode(ev)) => {
                if let Some(w) = ws.of_process(ev.tgid, lookup) {
                    w.correlator.on_episode(&ev);
                    w.signals.on_episode(ev.tgid, ev.tid, ev.t_first_launch_ns);
                    self.out.push(Routed::Episode {
                        root: w.root,
                        event: ev,
                    });
                }
            }
            Err(e) => {
                self.decode_errors += 1;
                log::debug!("undecodable record: {e}");
            }
        }
    }

    /// Routes one scheduler spell, from the kernel or from `/proc`
    /// (`--sched sampled`).
    pub fn route_sched(&mut self, ev: &SchedEvent, lookup: impl Fn(u32) -> Option<u32>) {
        if let Some(w) = self.workloads.of_process(ev.tgid, lookup) {
            w.signals.on_sched(ev);
        }
    }

    /// Queues the requests every workload has finished by `now_ns` (the
    /// correlator holds each until the client acknowledged its first
    /// token, so the retransmits before that have arrived).
    pub fn finish_requests(&mut self, now_ns: u64) {
        for w in self.workloads.by_root.values_mut() {
            queue_requests(&mut self.out, w.root, w.correlator.drain_finished(now_ns));
        }
    }

    /// Queues every request of workload `root` still open, finished as it
    /// stands (the workload ended, or tracing stops).
    pub fn flush(&mut self, root: u32) {
        if let Some(w) = self.workloads.by_root.get_mut(&root) {
            queue_requests(&mut self.out, root, w.correlator.flush());
        }
    }

    /// What was routed since the last call.
    pub fn take(&mut self) -> Vec<Routed> {
        std::mem::take(&mut self.out)
    }

    /// Drops signals older than any request still needs.
    pub fn prune(&mut self, now_ns: u64) {
        for w in self.workloads.by_root.values_mut() {
            w.signals.prune(now_ns);
        }
    }

    /// The request statistics of every live workload.
    pub fn stats(&self) -> impl Iterator<Item = (u32, CorrelatorStats)> + '_ {
        self.workloads
            .by_root
            .values()
            .map(|w| (w.root, w.correlator.stats()))
    }
}

fn queue_requests(out: &mut Vec<Routed>, root: u32, records: Vec<RequestRecord>) {
    out.extend(records.into_iter().map(|record| Routed::Request {
        root,
        record: Box::new(record),
    }));
}

#[cfg(test)]
mod tests {
    use ttft_trace_common::{
        EVENT_EPISODE,
        signals::{EVENT_TCP, TcpEvent},
    };

    use super::*;
    use crate::{decode::encode, workloads::WorkloadLabels};

    fn router() -> Router {
        let mut r = Router::default();
        r.workloads.insert(Workload::new(
            10,
            WorkloadLabels::default(),
            &CorrelatorConfig::default(),
        ));
        r
    }

    #[test]
    fn episodes_go_to_their_workload_and_on() {
        let mut r = router();
        let ep = EpisodeEvent {
            kind: EVENT_EPISODE,
            tgid: 11,
            tid: 12,
            t_first_launch_ns: 5,
            t_copy_done_ns: 9,
            ..EpisodeEvent::default()
        };
        r.route(&encode(&ep), |t| (t == 11).then_some(10));
        r.route(&encode(&EpisodeEvent { tgid: 99, ..ep }), |_| None);
        r.route(&[1, 2, 3], |_| None);
        let out = r.take();
        assert_eq!(out.len(), 1, "{out:?}");
        assert!(matches!(out[0], Routed::Episode { root: 10, event } if event.tgid == 11));
        assert_eq!((r.workloads.unrouted, r.decode_errors), (1, 1));
        assert!(r.take().is_empty(), "taken once");
    }

    #[test]
    fn tcp_events_are_counted_host_wide_even_unrouted() {
        let mut r = router();
        let ev = TcpEvent {
            kind: EVENT_TCP,
            sk: 0x77,
            what: 1,
            ..TcpEvent::default()
        };
        r.route(&encode(&ev), |_| None);
        assert!(matches!(r.take()[..], [Routed::Tcp { what: 1 }]));
    }
}
