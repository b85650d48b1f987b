//! Ring-buffer bytes to typed events. The kernel is trusted to send whole
//! records, but a short or unknown record is an error, never a panic.

use thiserror::Error;
use ttft_trace_common::{
    ConnEvent, EVENT_CONN, EVENT_EPISODE, EVENT_SEGMENT, EVENT_SOCK, EpisodeEvent, SegmentEvent,
    SockEvent,
    h2::{EVENT_H2, EVENT_H2_BLOCK, H2BlockEvent, H2FramesEvent},
    process::{DiscoverEvent, EVENT_DISCOVER},
    signals::{CopyEvent, EVENT_COPY, EVENT_SCHED, EVENT_TCP, SchedEvent, TcpEvent},
};

#[derive(Debug, Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("record of {0} bytes is too short for its kind")]
    Short(usize),
    #[error("unknown event kind {0}")]
    UnknownKind(u32),
}

/// A decoded ring-buffer record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Episode(EpisodeEvent),
    Conn(ConnEvent),
    /// Boxed: a send's captured bytes make it several times larger.
    Sock(Box<SockEvent>),
    Segment(SegmentEvent),
    /// Boxed: sixteen frame summaries.
    H2(Box<H2FramesEvent>),
    /// Boxed: a header block's bytes.
    H2Block(Box<H2BlockEvent>),
    Sched(SchedEvent),
    Tcp(TcpEvent),
    Copy(CopyEvent),
    /// Daemon mode: an untraced process called into a probed library.
    Discover(DiscoverEvent),
}

pub fn decode(bytes: &[u8]) -> Result<Event, DecodeError> {
    let kind = bytes
        .get(..4)
        .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        .ok_or(DecodeError::Short(bytes.len()))?;
    match kind {
        EVENT_EPISODE => read_pod::<EpisodeEvent>(bytes).map(Event::Episode),
        EVENT_CONN => read_pod::<ConnEvent>(bytes).map(Event::Conn),
        EVENT_SOCK => read_pod::<SockEvent>(bytes).map(|e| Event::Sock(Box::new(e))),
        EVENT_SEGMENT => read_pod::<SegmentEvent>(bytes).map(Event::Segment),
        EVENT_H2 => read_pod::<H2FramesEvent>(bytes).map(|e| Event::H2(Box::new(e))),
        EVENT_H2_BLOCK => read_pod::<H2BlockEvent>(bytes).map(|e| Event::H2Block(Box::new(e))),
        EVENT_SCHED => read_pod::<SchedEvent>(bytes).map(Event::Sched),
        EVENT_TCP => read_pod::<TcpEvent>(bytes).map(Event::Tcp),
        EVENT_COPY => read_pod::<CopyEvent>(bytes).map(Event::Copy),
        EVENT_DISCOVER => read_pod::<DiscoverEvent>(bytes).map(Event::Discover),
        other => Err(DecodeError::UnknownKind(other)),
    }
}

fn read_pod<T: aya::Pod>(bytes: &[u8]) -> Result<T, DecodeError> {
    if bytes.len() < std::mem::size_of::<T>() {
        return Err(DecodeError::Short(bytes.len()));
    }
    // SAFETY: length checked; T is Pod (any bit pattern valid); unaligned read.
    Ok(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

/// The bytes of a Pod value, as the kernel would send them (tests, benches).
pub fn encode<T: aya::Pod>(value: &T) -> Vec<u8> {
    // SAFETY: T is Pod: plain bytes with explicit padding, no references.
    unsafe {
        std::slice::from_raw_parts((value as *const T).cast::<u8>(), std::mem::size_of::<T>())
    }
    .to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> EpisodeEvent {
        EpisodeEvent {
            kind: EVENT_EPISODE,
            tgid: 100,
            tid: 101,
            completion: 2,
            api: 3,
            status: -7,
            kernel_launches: 12,
            graph_launches: 1,
            stream: 0xdead_beef,
            copy_stream: 0x10,
            t_first_launch_ns: 1_000,
            t_copy_enqueue_ns: 2_000,
            t_copy_done_ns: 3_500,
            copy_bytes: 4096,
        }
    }

    #[test]
    fn episode_round_trips() {
        let ev = sample();
        let bytes = encode(&ev);
        assert_eq!(bytes.len(), 80);
        assert_eq!(decode(&bytes), Ok(Event::Episode(ev)));
        // Field placement as the kernel writes it (little-endian host).
        assert_eq!(&bytes[4..8], &100u32.to_ne_bytes());
        assert_eq!(&bytes[48..56], &1_000u64.to_ne_bytes());
    }

    #[test]
    fn trailing_bytes_are_tolerated_short_ones_are_not() {
        let mut bytes = encode(&sample());
        bytes.extend_from_slice(&[0; 8]);
        assert!(decode(&bytes).is_ok());
        assert_eq!(decode(&bytes[..40]), Err(DecodeError::Short(40)));
        assert_eq!(decode(&[1, 0]), Err(DecodeError::Short(2)));
    }

    #[test]
    fn socket_events_round_trip() {
        let conn = ConnEvent {
            kind: EVENT_CONN,
            op: ttft_trace_common::CONN_OPEN,
            sk: 0xffff_8880_1234_5678,
            sport: 8000,
            dport: 51234,
            saddr: [127, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            ..ConnEvent::default()
        };
        assert_eq!(decode(&encode(&conn)), Ok(Event::Conn(conn)));
        let mut sock = SockEvent {
            dir: ttft_trace_common::SOCK_SEND,
            tgid: 9,
            bytes: 149,
            head_len: 8,
            tail_len: 5,
            flags: ttft_trace_common::SOCK_TLS_PLAIN,
            ..SockEvent::default()
        };
        sock.head[..8].copy_from_slice(b"HTTP/1.1");
        sock.tail[..5].copy_from_slice(b"0\r\n\r\n");
        let bytes = encode(&sock);
        assert_eq!(bytes.len(), 376);
        let Ok(Event::Sock(back)) = decode(&bytes) else {
            panic!("not a sock event");
        };
        assert_eq!(*back, sock);
        assert_eq!(back.head(), b"HTTP/1.1");
        assert_eq!(back.tail(), b"0\r\n\r\n");
        assert_eq!(decode(&bytes[..100]), Err(DecodeError::Short(100)));
    }

    #[test]
    fn segment_event_round_trips() {
        let seg = SegmentEvent {
            kind: EVENT_SEGMENT,
            flags: ttft_trace_common::SEGMENT_DATA | ttft_trace_common::SEGMENT_ACKED,
            sk: 0xffff_8880_1234_5678,
            t_ns: 2_000,
            t_prev_ns: 1_000,
            snd_una: 0xfffffff0,
            snd_nxt: 0x10,
            srtt_us: 21,
            data_len: 2027,
            ack_seq: 0x20,
            _pad: 0,
        };
        let bytes = encode(&seg);
        assert_eq!(bytes.len(), 56);
        assert_eq!(decode(&bytes), Ok(Event::Segment(seg)));
        // Field placement as the kernel writes it (little-endian host).
        assert_eq!(&bytes[24..32], &1_000u64.to_ne_bytes());
        assert_eq!(&bytes[32..36], &0xffff_fff0u32.to_ne_bytes());
        assert_eq!(&bytes[44..48], &2027u32.to_ne_bytes());
        assert_eq!(&bytes[48..52], &0x20u32.to_ne_bytes());
        assert_eq!(decode(&bytes[..55]), Err(DecodeError::Short(55)));
    }

    #[test]
    fn h2_frames_event_round_trips() {
        use ttft_trace_common::h2::{H2_HEADERS, H2_SEND, H2Frame};
        let mut ev = H2FramesEvent {
            dir: H2_SEND,
            tgid: 7,
            sk: 0xffff_8880_0000_0001,
            t_ns: 5_000,
            seq: 0xffff_fff0,
            bytes: 120,
            carry_in: 3,
            n_frames: 1,
            t_cut_ns: 77,
            ..H2FramesEvent::default()
        };
        ev.frames[0] = H2Frame {
            offset: 3,
            len: 40,
            stream: 5,
            kind: H2_HEADERS,
            flags: 4,
            head_len: 1,
            _pad: 0,
            head: [0x88, 0, 0, 0, 0, 0, 0, 0],
        };
        let bytes = encode(&ev);
        assert_eq!(bytes.len(), 64 + 24 * 16);
        let Ok(Event::H2(back)) = decode(&bytes) else {
            panic!("not an HTTP/2 event");
        };
        assert_eq!(*back, ev);
        assert_eq!(back.frames().len(), 1);
        assert_eq!(back.frames()[0].head(), &[0x88]);
        // Field placement as the kernel writes it (little-endian host).
        assert_eq!(&bytes[32..36], &0xffff_fff0u32.to_ne_bytes());
        assert_eq!(&bytes[56..64], &77u64.to_ne_bytes());
        assert_eq!(&bytes[64..68], &3u32.to_ne_bytes());
        assert_eq!(&bytes[72..76], &5u32.to_ne_bytes());
        assert_eq!(decode(&bytes[..100]), Err(DecodeError::Short(100)));
    }

    #[test]
    fn signal_events_round_trip() {
        let s = SchedEvent {
            kind: EVENT_SCHED,
            what: 2,
            tgid: 1,
            tid: 2,
            t_start_ns: 3,
            t_end_ns: 4,
        };
        assert_eq!(decode(&encode(&s)), Ok(Event::Sched(s)));
        let t = TcpEvent {
            kind: EVENT_TCP,
            what: 1,
            sk: 5,
            t_ns: 6,
        };
        assert_eq!(decode(&encode(&t)), Ok(Event::Tcp(t)));
        let c = CopyEvent {
            kind: EVENT_COPY,
            tgid: 1,
            tid: 2,
            direction: 1,
            bytes: 1 << 30,
            t_ns: 9,
        };
        assert_eq!(decode(&encode(&c)), Ok(Event::Copy(c)));
        assert_eq!(decode(&encode(&s)[..20]), Err(DecodeError::Short(20)));
    }

    #[test]
    fn discover_event_round_trips() {
        let d = DiscoverEvent {
            kind: EVENT_DISCOVER,
            tgid: 4242,
            t_ns: 77,
        };
        assert_eq!(decode(&encode(&d)), Ok(Event::Discover(d)));
        assert_eq!(decode(&encode(&d)[..12]), Err(DecodeError::Short(12)));
    }

    #[test]
    fn unknown_kind_is_an_error() {
        let mut ev = sample();
        ev.kind = 77;
        assert_eq!(decode(&encode(&ev)), Err(DecodeError::UnknownKind(77)));
    }
}
