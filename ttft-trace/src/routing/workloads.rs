//! The workloads and the maps from processes and sockets to them. One set
//! of eBPF programs feeds every workload through one ring buffer; each
//! workload has its own request correlator and signal store, so that its
//! requests join only its own GPU episodes and scheduler signals.
//!
//! Events name a process (`tgid`) or a socket (`sk`). A process's workload
//! is the value the kernel keeps for it in TRACKED (children inherit it); a
//! socket's is that of the first process seen receiving or sending on it.
//! The open event of a connection and its segments (`tcp_probe`) come from
//! softirq context with no process, so they are held until the
//! connection's first socket event says whose it is (two containers may
//! listen on the same port number).

use std::collections::{BTreeMap, HashMap, HashSet};

use ttft_trace_common::{ConnEvent, SegmentEvent, h2::H2FramesEvent};

use crate::{
    requests::{Correlator, CorrelatorConfig},
    signals::SignalStore,
    workloads::WorkloadLabels,
};

/// Connection opens waiting for their first socket event, at most this
/// many (opens on followed ports that no traced process ever reads).
const MAX_PENDING_OPENS: usize = 65536;
/// Segments held per connection before its first socket event (the
/// request's own, normally one or two).
const MAX_HELD_SEGMENTS: usize = 16;
/// Sockets bound to workloads, at most this many before those no
/// correlator follows any more (a lost close) are dropped: the kernel's
/// CONNS map holds as many.
const MAX_BOUND_SOCKETS: usize = 65536;

/// What a connection brings before its owner is known, to be delivered in
/// order once it is.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Unbound {
    pub open: Option<ConnEvent>,
    pub segments: Vec<SegmentEvent>,
    /// The client's HTTP/2 frames (walked at a segment, in softirq: no
    /// process either), within the same bound as the segments.
    pub h2: Vec<Box<H2FramesEvent>>,
}

/// One traced process tree.
pub struct Workload {
    /// Root process: the workload's id.
    pub root: u32,
    /// Labels its series carry (possibly the overflow set).
    pub labels: WorkloadLabels,
    /// `labels.values()`, kept for the metric calls.
    pub values: Vec<String>,
    pub correlator: Correlator,
    pub signals: SignalStore,
}

impl Workload {
    pub fn new(root: u32, labels: WorkloadLabels, cfg: &CorrelatorConfig) -> Self {
        Self {
            root,
            values: labels.values(),
            labels,
            correlator: Correlator::new(cfg.clone()),
            signals: SignalStore::default(),
        }
    }

    /// Label values as the metrics take them.
    pub fn label_values(&self) -> Vec<&str> {
        self.values.iter().map(String::as_str).collect()
    }
}

/// The workloads and the maps from processes and sockets to them.
#[derive(Default)]
pub struct Workloads {
    pub by_root: BTreeMap<u32, Workload>,
    /// tgid -> workload, as learnt from the kernel's TRACKED map.
    member: HashMap<u32, u32>,
    /// sk -> workload.
    conns: HashMap<u64, u32>,
    pending: HashMap<u64, Unbound>,
    /// Events of processes or sockets of no known workload (dropped).
    pub unrouted: u64,
    /// Held connection opens dropped because [`MAX_PENDING_OPENS`] were held.
    pub pending_opens_dropped: u64,
    /// Socket bindings dropped past [`MAX_BOUND_SOCKETS`].
    pub bound_sockets_dropped: u64,
}

impl Workloads {
    pub fn insert(&mut self, w: Workload) {
        self.member.insert(w.root, w.root);
        self.by_root.insert(w.root, w);
    }

    /// Records that `tgid` belongs to workload `root`.
    pub fn learn(&mut self, tgid: u32, root: u32) {
        if self.by_root.contains_key(&root) {
            self.member.insert(tgid, root);
        }
    }

    /// Forgets a process that exited, its last counters read: its
    /// signals, and its membership unless it is a workload's root (whose
    /// id stays until the workload ends).
    pub fn forget_process(&mut self, tgid: u32) {
        if let Some(w) = self.root_of(tgid).and_then(|r| self.by_root.get_mut(&r)) {
            w.signals.forget_process(tgid);
        }
        if !self.by_root.contains_key(&tgid) {
            self.member.remove(&tgid);
        }
    }

    /// The workload of `tgid`: known, or asked of the kernel with `lookup`.
    pub fn of_process(
        &mut self,
        tgid: u32,
        lookup: impl FnOnce(u32) -> Option<u32>,
    ) -> Option<&mut Workload> {
        let root = match self.member.get(&tgid) {
            Some(&r) => r,
            None => {
                let r = lookup(tgid).filter(|r| self.by_root.contains_key(r));
                match r {
                    Some(r) => {
                        self.member.insert(tgid, r);
                        r
                    }
                    None => {
                        self.unrouted += 1;
                        return None;
                    }
                }
            }
        };
        self.by_root.get_mut(&root)
    }

    /// The workload a process belongs to, without asking the kernel.
    pub fn root_of(&self, tgid: u32) -> Option<u32> {
        self.member.get(&tgid).copied()
    }

    /// Holds a connection's open event until its owner is known. A new
    /// connection may reuse the address of a closed socket whose last
    /// events (the read of the client's EOF) came after its close: that old
    /// binding is dropped here.
    pub fn hold_open(&mut self, ev: &ConnEvent) {
        if self.pending.len() >= MAX_PENDING_OPENS {
            self.pending_opens_dropped += self.pending.len() as u64;
            self.pending.clear();
        }
        self.conns.remove(&ev.sk);
        self.pending.insert(
            ev.sk,
            Unbound {
                open: Some(*ev),
                segments: Vec::new(),
                h2: Vec::new(),
            },
        );
    }

    /// The workload of a segment's socket; a segment of a connection whose
    /// owner is not known yet is held with its open event.
    pub fn route_segment(&mut self, ev: &SegmentEvent) -> Option<&mut Workload> {
        if let Some(root) = self.conns.get(&ev.sk).copied() {
            return self.by_root.get_mut(&root);
        }
        match self.pending.get_mut(&ev.sk) {
            Some(u) if u.segments.len() + u.h2.len() < MAX_HELD_SEGMENTS => u.segments.push(*ev),
            _ => self.unrouted += 1,
        }
        None
    }

    /// The workload of an HTTP/2 frames event's socket; one of a
    /// connection whose owner is not known yet is held with its open
    /// event (the client's first frames arrive before the server's first
    /// read or send names the owner).
    pub fn route_h2(
        &mut self,
        ev: Box<H2FramesEvent>,
    ) -> Option<(&mut Workload, Box<H2FramesEvent>)> {
        if let Some(root) = self.conns.get(&ev.sk).copied() {
            return self.by_root.get_mut(&root).map(|w| (w, ev));
        }
        match self.pending.get_mut(&ev.sk) {
            Some(u) if u.segments.len() + u.h2.len() < MAX_HELD_SEGMENTS => u.h2.push(ev),
            _ => self.unrouted += 1,
        }
        None
    }

    /// Binds socket `sk` to workload `root` on its first socket event;
    /// returns what was held for it, to deliver first.
    pub fn bind_socket(&mut self, sk: u64, root: u32) -> Option<Unbound> {
        if self.conns.contains_key(&sk) {
            return None;
        }
        self.conns.insert(sk, root);
        self.pending.remove(&sk)
    }

    /// The workload of socket `sk`; `closing` forgets the socket.
    pub fn of_socket(&mut self, sk: u64, closing: bool) -> Option<&mut Workload> {
        let root = if closing {
            self.pending.remove(&sk);
            self.conns.remove(&sk)
        } else {
            self.conns.get(&sk).copied()
        };
        match root {
            Some(r) => self.by_root.get_mut(&r),
            None => {
                self.unrouted += u64::from(!closing);
                None
            }
        }
    }

    /// Keeps what the live processes need: members that are alive (a
    /// workload's root stays while the workload does), their per-process
    /// signals, and, past [`MAX_BOUND_SOCKETS`], the sockets a correlator
    /// still follows. A process dropped here that still sends events is
    /// found again through the kernel (TRACKED, EXITED), a socket is bound
    /// again at its next socket event.
    pub fn prune(&mut self, live: &HashSet<u32>) {
        let by_root = &self.by_root;
        self.member.retain(|tgid, root| {
            live.contains(tgid) || (tgid == root && by_root.contains_key(root))
        });
        if self.conns.len() > MAX_BOUND_SOCKETS {
            let before = self.conns.len();
            self.conns
                .retain(|sk, root| by_root.get(root).is_some_and(|w| w.correlator.follows(*sk)));
            self.bound_sockets_dropped += (before - self.conns.len()) as u64;
        }
        for w in self.by_root.values_mut() {
            w.signals.retain_processes(|p| live.contains(&p));
        }
    }

    /// Entries of its tables: (table, entries).
    pub fn table_entries(&self) -> [(&'static str, usize); 4] {
        [
            ("routed_workloads", self.by_root.len()),
            ("routed_processes", self.member.len()),
            ("bound_sockets", self.conns.len()),
            ("pending_connection_opens", self.pending.len()),
        ]
    }

    /// Removes a workload that ended, with its processes and sockets.
    pub fn remove(&mut self, root: u32) -> Option<Workload> {
        self.member.retain(|_, r| *r != root);
        self.conns.retain(|_, r| *r != root);
        self.by_root.remove(&root)
    }

    /// Members known of workload `root`.
    pub fn members(&self, root: u32) -> impl Iterator<Item = u32> + '_ {
        self.member
            .iter()
            .filter(move |(_, r)| **r == root)
            .map(|(t, _)| *t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(root: u32, comm: &str) -> Workload {
        Workload::new(
            root,
            WorkloadLabels {
                comm: comm.into(),
                ..WorkloadLabels::default()
            },
            &CorrelatorConfig::default(),
        )
    }

    #[test]
    fn routes_processes_through_the_kernel_map_once() {
        let mut ws = Workloads::default();
        ws.insert(w(10, "a"));
        ws.insert(w(20, "b"));
        let mut asked = 0;
        let mut lookup = |t: u32| {
            asked += 1;
            (t == 11).then_some(10)
        };
        assert_eq!(ws.of_process(11, &mut lookup).map(|w| w.root), Some(10));
        assert_eq!(ws.of_process(11, &mut lookup).map(|w| w.root), Some(10));
        assert_eq!(ws.of_process(99, &mut lookup).map(|w| w.root), None);
        assert_eq!(asked, 2, "a known member is not looked up again");
        assert_eq!(ws.unrouted, 1);
        // A workload id the kernel gives that we do not know is not routed.
        assert!(ws.of_process(12, |_| Some(30)).is_none());
    }

    #[test]
    fn a_connection_belongs_to_its_first_reader() {
        let mut ws = Workloads::default();
        ws.insert(w(10, "a"));
        ws.insert(w(20, "b"));
        let open = ConnEvent {
            sk: 0xabc,
            sport: 8000,
            ..ConnEvent::default()
        };
        ws.hold_open(&open);
        assert!(ws.of_socket(0xabc, false).is_none(), "owner not known yet");
        let seg = SegmentEvent {
            sk: 0xabc,
            t_ns: 5,
            ..SegmentEvent::default()
        };
        assert!(ws.route_segment(&seg).is_none(), "held");
        // The client's HTTP/2 frames, walked at a segment: held too.
        let frames = Box::new(H2FramesEvent {
            sk: 0xabc,
            t_ns: 6,
            ..H2FramesEvent::default()
        });
        assert!(ws.route_h2(frames.clone()).is_none(), "held");
        assert_eq!(
            ws.bind_socket(0xabc, 20),
            Some(Unbound {
                open: Some(open),
                segments: vec![seg],
                h2: vec![frames.clone()],
            })
        );
        assert_eq!(ws.route_segment(&seg).map(|w| w.root), Some(20));
        assert_eq!(ws.route_h2(frames).map(|(w, _)| w.root), Some(20));
        assert_eq!(ws.bind_socket(0xabc, 10), None, "bound once");
        assert_eq!(ws.of_socket(0xabc, false).map(|w| w.root), Some(20));
        assert_eq!(ws.of_socket(0xabc, true).map(|w| w.root), Some(20));
        assert!(ws.of_socket(0xabc, false).is_none(), "forgotten at close");
        // A close of a connection never read drops its held open.
        ws.hold_open(&ConnEvent {
            sk: 0xdef,
            ..ConnEvent::default()
        });
        assert!(ws.of_socket(0xdef, true).is_none());
        assert_eq!(ws.bind_socket(0xdef, 10), None);
    }

    #[test]
    fn a_reused_socket_address_is_a_new_connection() {
        let mut ws = Workloads::default();
        ws.insert(w(10, "a"));
        let open = ConnEvent {
            sk: 0x7,
            ..ConnEvent::default()
        };
        ws.hold_open(&open);
        assert!(
            ws.bind_socket(0x7, 10)
                .is_some_and(|u| u.open == Some(open))
        );
        assert!(ws.of_socket(0x7, true).is_some(), "closed");
        // The server reads the client's EOF after the close: bound again.
        assert_eq!(ws.bind_socket(0x7, 10), None);
        // The address is reused by the next connection: its open is delivered.
        let next = ConnEvent {
            sk: 0x7,
            t_ns: 99,
            ..ConnEvent::default()
        };
        ws.hold_open(&next);
        assert!(
            ws.bind_socket(0x7, 10)
                .is_some_and(|u| u.open == Some(next))
        );
    }

    #[test]
    fn pruning_keeps_live_members_and_roots() {
        let mut ws = Workloads::default();
        ws.insert(w(10, "a"));
        ws.learn(11, 10);
        ws.learn(12, 10);
        ws.bind_socket(0x1, 10);
        // The root exited before its children: it stays while the workload does.
        ws.prune(&HashSet::from([11]));
        assert_eq!(ws.root_of(10), Some(10));
        assert_eq!(ws.root_of(11), Some(10));
        assert_eq!(ws.root_of(12), None, "exited member dropped");
        assert_eq!(
            ws.of_process(12, |_| Some(10)).map(|w| w.root),
            Some(10),
            "found again"
        );
        // Few sockets: bindings are kept even if not (yet) followed.
        assert!(ws.of_socket(0x1, false).is_some());
        assert_eq!(ws.bound_sockets_dropped, 0);
    }

    #[test]
    fn bound_sockets_past_the_bound_keep_only_followed_ones() {
        let mut ws = Workloads::default();
        ws.insert(w(10, "a"));
        for sk in 0..=MAX_BOUND_SOCKETS as u64 {
            ws.bind_socket(sk, 10);
        }
        ws.prune(&HashSet::new());
        assert_eq!(ws.bound_sockets_dropped, MAX_BOUND_SOCKETS as u64 + 1);
        assert!(ws.of_socket(5, false).is_none());
    }

    #[test]
    fn a_full_table_of_held_opens_is_counted_when_dropped() {
        let mut ws = Workloads::default();
        for sk in 0..=MAX_PENDING_OPENS as u64 {
            ws.hold_open(&ConnEvent {
                sk,
                ..ConnEvent::default()
            });
        }
        assert_eq!(ws.pending_opens_dropped, MAX_PENDING_OPENS as u64);
    }

    #[test]
    fn removing_a_workload_forgets_its_members_and_sockets() {
        let mut ws = Workloads::default();
        ws.insert(w(10, "a"));
        ws.learn(11, 10);
        ws.learn(12, 99);
        ws.bind_socket(0x1, 10);
        assert_eq!(ws.members(10).count(), 2);
        assert_eq!(ws.root_of(12), None, "unknown workload not learnt");
        assert!(ws.remove(10).is_some());
        assert_eq!(ws.root_of(11), None);
        assert!(ws.of_socket(0x1, false).is_none());
    }
}
