//! The offsets the probes are given, from a kernel description: the
//! tracepoints' fields from their format files, and the few struct
//! offsets from BTF that the classic programs read on top.

use ttft_trace_common::{TracepointOffsets, offsets::ABSENT};

use crate::host::tracefs::TracefsError;
use crate::probes::{
    btf::{self, BtfFacts},
    kernel::Tracepoints,
};

/// The fields of the tracepoints every hook uses. The syscall send hook's
/// and the BTF ones are [`ABSENT`] here: see [`syscall_fields`] and
/// [`ack_timing`], [`namespaces`].
pub fn tracepoint_offsets(tp: &Tracepoints) -> Result<TracepointOffsets, TracefsError> {
    let mut o = TracepointOffsets {
        write_buf: ABSENT,
        sendto_buf: ABSENT,
        writev_vec: ABSENT,
        writev_vlen: ABSENT,
        sendmsg_msg: ABSENT,
        skb_ack_seq: ABSENT,
        sk_net: ABSENT,
        net_inum: ABSENT,
        ..TracepointOffsets::default()
    };
    process_fields(tp, &mut o)?;
    state_fields(tp, &mut o)?;
    length_fields(tp, &mut o)?;
    scheduler_fields(tp, &mut o)?;
    tcp_fields(tp, &mut o)?;
    probe_fields(tp, &mut o)?;
    Ok(o)
}

fn process_fields(tp: &Tracepoints, o: &mut TracepointOffsets) -> Result<(), TracefsError> {
    o.fork_child_pid = tp
        .format("sched", "sched_process_fork")?
        .offset("child_pid")?;
    let exit = tp.format("sched", "sched_process_exit")?;
    o.exit_group_dead = exit.optional_offset("group_dead").unwrap_or(ABSENT);
    Ok(())
}

fn state_fields(tp: &Tracepoints, o: &mut TracepointOffsets) -> Result<(), TracefsError> {
    let state = tp.format("sock", "inet_sock_set_state")?;
    o.state_skaddr = state.offset("skaddr")?;
    o.state_oldstate = state.offset("oldstate")?;
    o.state_newstate = state.offset("newstate")?;
    o.state_sport = state.offset("sport")?;
    o.state_dport = state.offset("dport")?;
    o.state_family = state.offset("family")?;
    o.state_saddr = state.offset("saddr")?;
    o.state_daddr = state.offset("daddr")?;
    o.state_saddr_v6 = state.offset("saddr_v6")?;
    o.state_daddr_v6 = state.offset("daddr_v6")?;
    Ok(())
}

/// One set of offsets serves both length tracepoints: checked to agree.
fn length_fields(tp: &Tracepoints, o: &mut TracepointOffsets) -> Result<(), TracefsError> {
    let len = tp.format("sock", "sock_send_length")?;
    let recv = tp.format("sock", "sock_recv_length")?;
    o.len_sk = len.offset("sk")?;
    o.len_ret = len.offset("ret")?;
    o.len_flags = len.offset("flags")?;
    for field in ["sk", "ret", "flags"] {
        if recv.offset(field)? != len.offset(field)? {
            return Err(TracefsError::Parse(
                "sock:sock_recv_length".into(),
                format!("field {field} is not where sock_send_length has it"),
            ));
        }
    }
    Ok(())
}

fn scheduler_fields(tp: &Tracepoints, o: &mut TracepointOffsets) -> Result<(), TracefsError> {
    let switch = tp.format("sched", "sched_switch")?;
    o.switch_prev_state = switch.offset("prev_state")?;
    o.switch_next_pid = switch.offset("next_pid")?;
    o.wakeup_pid = tp.format("sched", "sched_wakeup")?.offset("pid")?;
    if tp.format("sched", "sched_wakeup_new")?.offset("pid")? != o.wakeup_pid {
        return Err(TracefsError::Parse(
            "sched:sched_wakeup_new".into(),
            "pid is not where sched_wakeup has it".into(),
        ));
    }
    Ok(())
}

fn tcp_fields(tp: &Tracepoints, o: &mut TracepointOffsets) -> Result<(), TracefsError> {
    o.retransmit_sk = tp.format("tcp", "tcp_retransmit_skb")?.offset("skaddr")?;
    o.reset_received_sk = tp.format("tcp", "tcp_receive_reset")?.offset("skaddr")?;
    o.reset_sent_sk = tp.format("tcp", "tcp_send_reset")?.offset("skaddr")?;
    Ok(())
}

fn probe_fields(tp: &Tracepoints, o: &mut TracepointOffsets) -> Result<(), TracefsError> {
    let probe = tp.format("tcp", "tcp_probe")?;
    o.probe_sk = probe.offset("skaddr")?;
    o.probe_data_len = probe.offset("data_len")?;
    o.probe_snd_nxt = probe.offset("snd_nxt")?;
    o.probe_snd_una = probe.offset("snd_una")?;
    o.probe_srtt = probe.offset("srtt")?;
    o.probe_sport = probe.offset("sport")?;
    o.probe_dport = probe.offset("dport")?;
    o.probe_family = probe.offset("family")?;
    o.probe_saddr = probe.offset("saddr")?;
    o.probe_daddr = probe.offset("daddr")?;
    o.probe_skb = probe.optional_offset("skbaddr").unwrap_or(ABSENT);
    Ok(())
}

/// Fills in the syscall send hook's fields, where all of them can be read.
pub fn syscall_fields(tp: &Tracepoints, o: &mut TracepointOffsets) -> Result<(), TracefsError> {
    let write = tp.format("syscalls", "sys_enter_write")?;
    let sendto = tp.format("syscalls", "sys_enter_sendto")?;
    let writev = tp.format("syscalls", "sys_enter_writev")?;
    let sendmsg = tp.format("syscalls", "sys_enter_sendmsg")?;
    let fields = (
        write.offset("buf")?,
        sendto.offset("buff")?,
        writev.offset("vec")?,
        writev.offset("vlen")?,
        sendmsg.offset("msg")?,
    );
    (
        o.write_buf,
        o.sendto_buf,
        o.writev_vec,
        o.writev_vlen,
        o.sendmsg_msg,
    ) = fields;
    Ok(())
}

/// Where `tcp_probe` finds a segment's own acknowledgment number (with its
/// `skbaddr` field), filled in; or why not: then what a segment
/// acknowledged is seen at the next segment (and the last one's never).
pub fn ack_timing(
    btf: Result<&BtfFacts, &String>,
    o: &mut TracepointOffsets,
) -> Result<(), String> {
    let btf = btf.map_err(String::clone)?;
    if o.probe_skb == ABSENT {
        return Err("tcp:tcp_probe has no skbaddr on this kernel".into());
    }
    o.skb_ack_seq = btf::skb_ack_seq_offset(btf).map_err(|e| e.to_string())?;
    Ok(())
}

/// A socket's network namespace, filled in; or why not: then listening
/// ports are matched in every namespace.
pub fn namespaces(
    btf: Result<&BtfFacts, &String>,
    o: &mut TracepointOffsets,
) -> Result<(), String> {
    let btf = btf.map_err(String::clone)?;
    (o.sk_net, o.net_inum) = btf::netns_offsets(btf).map_err(|e| e.to_string())?;
    Ok(())
}
