//! What the BTF scheduler and socket-length programs read: the hot
//! tracepoints' prototypes and `task_struct` (its pid, and `sched_info`).

use ttft_trace_common::offsets::{ABSENT, TaskOffsets};

use super::{BtfError, Layouts};

/// The raw tracepoints of the hot path and what their arguments must point
/// to, in order ("" for an argument that is not a struct pointer): the
/// probes read these slots by index, so each prototype is checked.
/// `sched_switch` has had `prev_state` as its fourth argument since 5.18.
pub const HOT_PROTOTYPES: &[(&str, &[&str])] = &[
    ("sched_switch", &["", "task_struct", "task_struct", ""]),
    ("sched_wakeup", &["task_struct"]),
    ("sched_wakeup_new", &["task_struct"]),
    ("sock_send_length", &["sock", "", ""]),
    ("sock_recv_length", &["sock", "", ""]),
];

/// The offsets the raw scheduler tracepoints need, after checking every
/// prototype of [`HOT_PROTOTYPES`].
pub fn task_offsets(btf: &dyn Layouts) -> Result<TaskOffsets, BtfError> {
    for &(tracepoint, want) in HOT_PROTOTYPES {
        let args = btf.tracepoint_args(tracepoint)?;
        if args != want {
            return Err(BtfError::Unexpected(format!(
                "{tracepoint} takes ({}), not ({})",
                args.join(", "),
                want.join(", ")
            )));
        }
    }
    let (pid, size) = btf.member("task_struct", "pid")?;
    if size != 4 {
        return Err(BtfError::Unexpected(format!(
            "task_struct.pid is {size} bytes, not 4"
        )));
    }
    let (last_queued, last_arrival) = sched_info_offsets(btf).unwrap_or((ABSENT, ABSENT));
    Ok(TaskOffsets {
        pid,
        last_queued,
        last_arrival,
    })
}

/// `task_struct.sched_info.last_queued` and `.last_arrival` (8 bytes each),
/// from the start of `task_struct`; an error on kernels without
/// CONFIG_SCHED_INFO.
fn sched_info_offsets(btf: &dyn Layouts) -> Result<(u32, u32), BtfError> {
    let (info, _) = btf.member("task_struct", "sched_info")?;
    let member = |name: &str| -> Result<u32, BtfError> {
        let (off, size) = btf.member("sched_info", name)?;
        if size != 8 {
            return Err(BtfError::Unexpected(format!(
                "sched_info.{name} is {size} bytes, not 8"
            )));
        }
        Ok(info + off)
    };
    Ok((member("last_queued")?, member("last_arrival")?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probes::btf::{
        Btf,
        builder::{Builder, kernel_like},
        parse::{KIND_PTR, KIND_STRUCT},
    };

    /// The hot tracepoints' prototypes as 6.18 has them, `sched_switch`
    /// with or without `prev_state` (before 5.18), and `task_struct.pid`.
    fn scheduler_like(with_prev_state: bool, pid_size: u32) -> Vec<u8> {
        scheduler_with(with_prev_state, pid_size, "sched_info")
    }

    /// As [`scheduler_like`], the `sched_info` member named `info` (another
    /// name: a kernel without CONFIG_SCHED_INFO).
    fn scheduler_with(with_prev_state: bool, pid_size: u32, info: &str) -> Vec<u8> {
        let mut b = Builder::new();
        let int_t = b.int("int", 4);
        let pid_t = b.int("pid_t", pid_size);
        let bool_t = b.int("_Bool", 1);
        let void_ptr = b.push("", KIND_PTR, 0, 0);
        let u64_t = b.int("long long unsigned int", 8);
        let sched_info = b.record(
            KIND_STRUCT,
            "sched_info",
            48,
            &[
                ("pcount", u64_t, 0),
                ("run_delay", u64_t, 8),
                ("last_arrival", u64_t, 32),
                ("last_queued", u64_t, 40),
            ],
        );
        let task = b.record(
            KIND_STRUCT,
            "task_struct",
            2048,
            &[
                ("__state", int_t, 24),
                (info, sched_info, 1000),
                ("pid", pid_t, 1496),
            ],
        );
        let task_ptr = b.push("", KIND_PTR, 0, task);
        let sock = b.record(KIND_STRUCT, "sock", 8, &[("sk_x", int_t, 0)]);
        let sock_ptr = b.push("", KIND_PTR, 0, sock);
        let typedef =
            |b: &mut Builder, name: &str, args: &[u32]| b.tracepoint(name, void_ptr, args);
        if with_prev_state {
            typedef(&mut b, "sched_switch", &[bool_t, task_ptr, task_ptr, int_t]);
        } else {
            typedef(&mut b, "sched_switch", &[bool_t, task_ptr, task_ptr]);
        }
        typedef(&mut b, "sched_wakeup", &[task_ptr]);
        typedef(&mut b, "sched_wakeup_new", &[task_ptr]);
        typedef(&mut b, "sock_send_length", &[sock_ptr, int_t, int_t]);
        typedef(&mut b, "sock_recv_length", &[sock_ptr, int_t, int_t]);
        b.blob()
    }

    #[test]
    fn task_offsets_follow_the_prototypes() {
        let btf = Btf::parse(&scheduler_like(true, 4)).expect("parse");
        assert_eq!(
            task_offsets(&btf).expect("offsets"),
            TaskOffsets {
                pid: 1496,
                last_queued: 1040,
                last_arrival: 1032,
            }
        );
        // Before 5.18 sched_switch has no prev_state: the classic tracepoint.
        // Without CONFIG_SCHED_INFO: the wakeup programs tell wakeups.
        let btf = Btf::parse(&scheduler_with(true, 4, "other")).expect("parse");
        let off = task_offsets(&btf).expect("offsets");
        assert_eq!((off.pid, off.has_sched_info()), (1496, false));
        let btf = Btf::parse(&scheduler_like(false, 4)).expect("parse");
        let err = task_offsets(&btf).expect_err("three-argument sched_switch");
        assert!(err.to_string().contains("sched_switch"), "{err}");
        // A pid the probe would read wrongly.
        let btf = Btf::parse(&scheduler_like(true, 8)).expect("parse");
        assert!(task_offsets(&btf).is_err());
        // A kernel without the sock tracepoints (before 6.3).
        let btf = Btf::parse(&kernel_like(8)).expect("parse");
        assert!(matches!(task_offsets(&btf), Err(BtfError::Missing(_))));
    }
}
