#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets into fuzz/corpus/TARGET/.

Each seed is a small valid input, made from the project's own fixtures and
tests, in the layout the target reads (see fuzz/fuzz_targets/*.rs), so that a
short run of `cargo xtask fuzz` starts past the parsers' first checks. The
seeds are kept in the repo; rerun this after changing a target's input layout
or an event struct of ttft-trace-common (the struct layouts below follow
ttft-trace-common/src/{event,signals,process}.rs). Needs python3 and gcc.

    python3 fuzz/make_seeds.py
"""

import pathlib
import shutil
import struct
import subprocess
import tempfile

CORPUS = pathlib.Path(__file__).resolve().parent / "corpus"
MS = 1_000_000
T0 = 1_000 * MS

# ---------------------------------------------------------------- ring_records
# Event tags and the structs' layouts (repr(C), little-endian on x86-64).
EVENT_EPISODE, EVENT_CONN, EVENT_SCHED, EVENT_TCP, EVENT_COPY = 1, 2, 4, 5, 6
EVENT_SEGMENT, EVENT_DISCOVER = 7, 16
SK = 0xFFFF_8880_0A00_1000  # a socket's kernel address


def episode(tgid, tid, t_launch, t_done, launches=12, completion=2, api=1):
    return struct.pack(
        "<IIIIIiIIQQQQQQ", EVENT_EPISODE, tgid, tid, completion, api, 0, launches, 0,
        0x7F00_0000_1000, 0x7F00_0000_1000, t_launch, t_done - MS, t_done, 4096,
    )


def conn(op, t, sk=SK, oldstate=3, newstate=1, t_last=0):
    lo = bytes([127, 0, 0, 1]) + bytes(12)
    return struct.pack(
        "<IIIIQQHHHH16s16sQII", EVENT_CONN, op, oldstate, newstate, sk, t, 2, 8000, 40000, 0,
        lo, lo, t_last, 1000, 1,
    )


def segment(flags, t, t_prev, snd_una, snd_nxt, data_len, ack_seq=0, sk=SK):
    return struct.pack(
        "<IIQQQIIIIII", EVENT_SEGMENT, flags, sk, t, t_prev, snd_una, snd_nxt, 80, data_len,
        ack_seq, 0,
    )


def sched(what, tgid, tid, start, end):
    return struct.pack("<IIIIQQ", EVENT_SCHED, what, tgid, tid, start, end)


def tcp(what, t, sk=SK):
    return struct.pack("<IIQQ", EVENT_TCP, what, sk, t)


def copy(tgid, tid, direction, size, t):
    return struct.pack("<IIIIQQ", EVENT_COPY, tgid, tid, direction, size, t)


def discover(tgid, t):
    return struct.pack("<IIQ", EVENT_DISCOVER, tgid, t)


# The sizes the decoder reads (ttft-trace-common's own asserts and layouts).
assert len(episode(0, 0, 0, MS)) == 80
assert len(conn(0, 0)) == 88
assert len(segment(0, 0, 0, 0, 0, 0)) == 56
assert len(sched(0, 0, 0, 0, 0)) == 32 and len(copy(0, 0, 0, 0, 0)) == 32
assert len(tcp(0, 0)) == 24 and len(discover(0, 0)) == 16


def records(*recs):
    """The target's input: each record after a byte of its length."""
    out = b""
    for r in recs:
        assert len(r) <= 255, len(r)
        out += bytes([len(r)]) + r
    return out


def ring_records():
    t = T0
    # The target's workload holds the even process ids: 10 is traced.
    return {
        "episodes": records(
            episode(10, 11, t, t + 40 * MS),
            episode(10, 11, t + 50 * MS, t + 70 * MS, completion=1),
            episode(10, 12, t + 80 * MS, t + 300 * MS, api=3, launches=400),
        ),
        "connection": records(
            conn(1, t),
            segment(1, t + MS, t, 1000, 1000, 180),
            tcp(1, t + 5 * MS),
            segment(2 | 4, t + 30 * MS, t + MS, 1000, 1600, 0, ack_seq=1600),
            conn(2, t + 40 * MS, oldstate=1, newstate=8, t_last=t + 30 * MS),
            conn(3, t + 41 * MS, oldstate=8, newstate=7),
        ),
        "signals": records(
            discover(10, t),
            sched(1, 10, 11, t, t + 5 * MS),
            sched(2, 10, 11, t + 5 * MS, t + 9 * MS),
            sched(3, 10, 12, t, t + 20 * MS),
            copy(10, 11, 1, 512 << 20, t + 10 * MS),
            copy(10, 11, 2, 4096, t + 12 * MS),
            tcp(2, t + 15 * MS),
        ),
        "mixed": records(
            conn(1, t),
            segment(1, t + MS, t, 1000, 1000, 180),
            sched(2, 10, 11, t + MS, t + 3 * MS),
            episode(10, 11, t + 3 * MS, t + 60 * MS),
            copy(10, 11, 2, 1 << 20, t + 55 * MS),
            segment(2, t + 90 * MS, t + MS, 1400, 1400, 0),
            conn(2, t + 100 * MS, oldstate=1, newstate=4),
            episode(9, 9, t, t + 10 * MS),
        ),
    }


# -------------------------------------------------------------- http_responses
# The target's operations: op, time step (ms / 4), connection slot, then the
# op's own bytes.
def op_open(slot, dt=4):
    return bytes([0, dt, slot])


def op_recv(slot, size_byte=40, dt=4):  # bytes = size_byte * 8 - 64
    return bytes([1, dt, slot, size_byte])


def op_send(slot, data, dt=4):
    assert len(data) <= 255, len(data)
    return bytes([2, dt, slot, len(data)]) + data


def op_close(slot, dt=4):
    return bytes([4, dt, slot])


def op_episode(slot, run_half_ms=40, dt=4):
    return bytes([5, dt, slot, run_half_ms])


def op_segment(slot, seq, acked=False, dt=4):
    return bytes([14 if acked else 6, dt, slot]) + struct.pack("<II", seq, 0)


def op_drain(dt=4):
    return bytes([7, dt, 0])


def chunk(data):
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def token(i):
    return chunk(b'data: {"choices":[{"index":0,"text":"t%d"}]}\n\n' % i)


def json_response(body, status=b"200 OK"):
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body) + body
    )


def http_responses():
    sse = (
        op_open(0) + op_segment(0, 1000) + op_recv(0) + op_episode(0)
        + op_send(0, SSE_HEAD, dt=40) + op_send(0, token(0))
        + b"".join(op_send(0, token(i), dt=8) for i in range(1, 4))
        + op_send(0, chunk(b"data: [DONE]\n\n")) + op_send(0, b"0\r\n\r\n")
        + op_segment(0, 1900, acked=True) + op_drain() + op_close(0) + op_drain()
    )
    body = b'{"choices":[{"index":0,"text":"hello"}]}'
    json = (
        op_open(1) + op_recv(1) + op_episode(1, 20)
        + op_send(1, json_response(body), dt=30) + op_drain() + op_close(1)
    )
    keep_alive = op_open(2) + b"".join(
        op_recv(2, dt=20) + op_episode(2, 10) + op_send(2, json_response(body), dt=12)
        for _ in range(3)
    ) + op_drain() + op_close(2)
    head_apart = (
        op_open(3) + op_recv(3) + op_episode(3)
        + op_send(3, json_response(body)[: -len(body)], dt=20) + op_send(3, body)
        + op_drain() + op_close(3)
    )
    interleaved = (
        op_open(0) + op_open(1) + op_recv(0) + op_recv(1) + op_episode(0)
        + op_send(0, SSE_HEAD) + op_send(1, json_response(b"", b"503 Service Unavailable"))
        + op_send(0, token(0)) + op_close(1) + op_send(0, token(1), dt=200)
        + op_close(0) + op_drain()
    )
    return {
        "sse-stream": sse,
        "json-content-length": json,
        "keep-alive-three-requests": keep_alive,
        "headers-sent-apart": head_apart,
        "two-connections-503-and-cut-stream": interleaved,
    }


# ----------------------------------------------------------------- proc_files
# A selector byte (maps, net/tcp, cgroup, status and stat), then the file.
MAPS = """\
55d0c0a00000-55d0c0a01000 r--p 00000000 fd:01 1234 /usr/bin/python3.11
55d0c0a01000-55d0c0a02000 r-xp 00001000 fd:01 1234 /usr/bin/python3.11
7f0000000000-7f0000001000 r-xp 00000000 fd:01 99 /opt/my lib/libcudart-4e0b8a1f.so.12
7f0000001000-7f0000002000 r-xp 00000000 fd:01 98 /usr/lib/x86_64-linux-gnu/libcuda.so.1
7f0000002000-7f0000003000 rw-p 00000000 00:00 0
7f0000004000-7f0000005000 r-xp 00000000 fd:01 77 /tmp/old.so (deleted)
7f0000006000-7f0000007000 rw-s 00000000 00:05 401 /dev/nvidiactl
7ffd00000000-7ffd00001000 r-xp 00000000 00:00 0                          [vdso]
"""
NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 123456 1 0000000000000000 100 0 0 10 0
   1: 0100007F:1F40 0100007F:D2A4 01 00000000:00000000 00:00000000 00000000     0        0 123457 1 0000000000000000 20 4 30 10 -1
"""
NET_TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:1F41 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 223456 1 0000000000000000 100 0 0 10 0
"""
CONTAINER = "4e0b8a1f" * 8
CGROUPS = {
    "cgroup-v2-service": "0::/system.slice/vllm.service\n",
    "cgroup-v1-docker": f"12:pids:/a\n4:cpu,cpuacct:/docker/{CONTAINER}\n1:name=systemd:/b\n",
    "cgroup-v2-kubepods-systemd": "0::/kubepods.slice/kubepods-besteffort.slice/"
    "kubepods-besteffort-pod1b2c3d4e_5f60_7182_93a4_b5c6d7e8f901.slice/"
    f"cri-containerd-{CONTAINER}.scope\n",
    "cgroup-v2-kubepods-cgroupfs": "0::/kubepods/besteffort/"
    f"pod1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901/{CONTAINER}\n",
    "cgroup-v2-podman": f"0::/machine.slice/libpod-{CONTAINER}.scope/container\n",
}
STATUS = (
    "Name:\tpython3\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t1234\nNgid:\t0\n"
    "Pid:\t1234\nPPid:\t77\nTracerPid:\t0\nNSpid:\t1234\t1\n"
)
STAT = "1234 (python3 (x) y) S 77 1234 1234 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 4 0 1000\n"


def proc_files():
    seeds = {"maps": b"\0" + MAPS.encode(), "net-tcp": b"\1" + NET_TCP.encode()}
    seeds["net-tcp6"] = b"\1" + NET_TCP6.encode()
    for name, text in CGROUPS.items():
        seeds[name] = b"\2" + text.encode()
    seeds["status"] = b"\3" + STATUS.encode()
    seeds["stat"] = b"\3" + STAT.encode()
    seeds["zombie-status"] = b"\3" + b"Name:\tx\nState:\tZ (zombie)\nTgid:\t5\n"
    return seeds


# --------------------------------------------------------------- config_files
DAEMON_TOML = """\
listen = "0.0.0.0:9464"
jsonl = "/var/log/ttft-trace/requests.jsonl"
slo_ms = 350
sched_min_us = 1000
sched = "exact"
sched_sample_ms = 10
ringbuf_bytes = 4194304
interval_s = 60
[discovery]
comm = "^(python|vllm|tritonserver)"
cgroup_prefix = "/kubepods"
ports = [8000]
rescan_ms = 1000
detach_unmapped_s = 60
[labels]
pid = false
max_sets = 100
retire_after_s = 300
[nvml]
enabled = true
period_ms = 100
library = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
[kernel_maps]
tracked = 16384
listen_netns = 4096
conns = 65536
[causes]
queueing_min_ns = 2000000000
"""
OTLP_TOML = """\
listen = ""
sched = "sampled"
[otlp]
endpoint = "http://collector:4317"
protocol = "http/protobuf"
sample_ratio = 0.1
queue_requests = 2048
gen_ai_operation_name = "chat"
"""
SOAK_TOML = """\
listen = "127.0.0.1:0"
[discovery]
ports = [8000, 8001]
rescan_ms = 200
[labels]
retire_after_s = 5
[nvml]
enabled = false
"""
CAUSES_JSON = """\
{"slow_ttft_ns": 350000000, "queueing_min_ns": 2000000000, "queueing_min_busy_share": 0.5,
 "batching_min_idle_ns": 100000000, "batching_max_cpu_share": 0.5,
 "batching_min_gpu_blocked_share": 0.5, "cpu_min_runq_ns": 50000000,
 "cpu_min_stage_ns": 100000000, "network_min_delivery_ns": 100000000,
 "gpu_memory_share": 0.95, "swap_min_bytes": 268435456, "cold_start_window_ns": 0,
 "load_min_bytes": 1073741824}
"""


def config_files():
    return {
        "daemon.toml": DAEMON_TOML.encode(),
        "otlp.toml": OTLP_TOML.encode(),
        "soak.toml": SOAK_TOML.encode(),
        "causes.json": CAUSES_JSON.encode(),
        "causes-subset.json": b'{"slow_ttft_ns": 200000000, "gpu_memory_share": 0.9}\n',
    }


# ------------------------------------------------------------------ elf_files
# Small shared libraries defining the probed entry points, as the CUDA
# runtime (versioned symbols, as the real libcudart.so.12) and driver do.
RUNTIME_C = """\
int cudaLaunchKernel(void) { return 1; }
int cudaGraphLaunch(void) { return 2; }
int cudaMemcpyAsync(void) { return 3; }
int cudaStreamSynchronize(void) { return 4; }
int cudaDeviceSynchronize(void) { return 5; }
"""
DRIVER_C = """\
int cuLaunchKernel(void) { return 1; }
int cuMemcpyDtoHAsync_v2(void) { return 2; }
int cuMemcpyDtoH_v2(void) { return 3; }
int cuStreamSynchronize(void) { return 4; }
int cuCtxSynchronize(void) { return 5; }
"""
WRAPPER_C = "int cudaMemcpy(void) { return 1; }\nint helper(void) { return 2; }\n"
SMALL = ["-shared", "-fPIC", "-nostdlib", "-Os", "-Wl,--build-id=none",
         "-Wl,-z,noseparate-code", "-Wl,--hash-style=gnu"]


def elf_files():
    seeds = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        (tmp / "rt.map").write_text("libcudart.so.12 { global: *; };\n")
        builds = {
            "runtime-versioned.so": (RUNTIME_C, ["-s", "-Wl,-soname,libcudart.so.12",
                                                 f"-Wl,--version-script={tmp / 'rt.map'}"]),
            "runtime-with-symtab.so": (RUNTIME_C, ["-Wl,-soname,libcudart.so.12"]),
            "driver.so": (DRIVER_C, ["-s", "-Wl,-soname,libcuda.so.1"]),
            "copy-wrapper-not-cuda.so": (WRAPPER_C, ["-s"]),
        }
        for name, (source, flags) in builds.items():
            (tmp / "src.c").write_text(source)
            subprocess.run(["gcc", *SMALL, *flags, "-o", tmp / name, tmp / "src.c"], check=True)
            seeds[name] = (tmp / name).read_bytes()
    return seeds


def main():
    targets = {
        "ring_records": ring_records(),
        "http_responses": http_responses(),
        "proc_files": proc_files(),
        "config_files": config_files(),
        "elf_files": elf_files(),
    }
    for target, seeds in targets.items():
        out = CORPUS / target
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for name, data in seeds.items():
            (out / name).write_bytes(data)
        print(f"{target}: {len(seeds)} seeds, {sum(map(len, seeds.values()))} bytes")


if __name__ == "__main__":
    main()
