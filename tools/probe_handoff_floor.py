"""The floor of a 4 KiB GPU hand-off between two Python processes on this host, with no kvstrata machinery.

What the 4 KiB target of ``kvstrata bench device`` is up against: the owner, idle ``QUIET_S``, stamps its
start, checks its stream (``stream.query()``) and sends one datagram naming the round; the reader, blocked on
its socket (or polling it), copies 4 KiB from the owner's buffer (opened once through CUDA IPC, as
``kvstrata.devobj.ipc`` does) with one ``cudaMemcpyAsync`` on a side stream, polls the stream until the copy
ended, and stamps its end (one monotonic clock for the node). Variants, round by round in one pair of
processes (the host's speed drifts): ``block`` (the reader's main thread blocks in ``recv``), ``poll`` (it polls
the socket, never sleeping) and ``thread`` (a background thread blocks in ``recv`` and copies, then sets a
``Future`` the main thread waits on: one more thread hand-off, as a library with an event thread has).

    PYTHONPATH=src python3 tools/probe_handoff_floor.py [--devices 0,1] [--iters 100]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
import threading
import time
from concurrent.futures import Future

from kvstrata.bench._procs import get_queued
from kvstrata.bench.device import QUIET_S, _ctx, _spawn

VARIANTS = ("block", "poll", "thread")
_MSG = struct.Struct("qd")  # round, the owner's start stamp
_WAIT = 120.0


def _address(tag: str) -> bytes:
    return b"\0kvstrata-floor/" + tag.encode()


def owner(device: int, rounds: int, ctl: dict, tag: str) -> dict:
    import torch

    from kvstrata.devobj.ipc import export_tensor

    torch.cuda.set_device(device)
    src = (torch.arange(4096, device=device) % 251).to(torch.uint8)
    torch.cuda.synchronize()
    ctl["blob"].put(export_tensor(src))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stream = torch.cuda.current_stream(device)
    starts = {}
    for _ in range(rounds):
        i = get_queued(ctl["go"], "owner: next round", _WAIT)
        if i is None:
            break
        time.sleep(QUIET_S)
        t0 = time.perf_counter()
        stream.query()  # a publish checks that its stream reached the publish point
        sock.sendto(_MSG.pack(i, t0), _address(tag))
        starts[i] = t0
    get_queued(ctl["go"], "owner: the end", _WAIT)
    return {"starts": starts}


def reader(device: int, iters: int, ctl: dict, tag: str) -> dict:
    import torch

    from kvstrata.devobj.ipc import import_tensor
    from kvstrata.ops.copy_engine import memcpy_raw

    torch.cuda.set_device(device)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(_address(tag))
    blob = get_queued(ctl["blob"], "reader: the owner's export", _WAIT)
    src = import_tensor(blob, torch.uint8, device)
    dst = torch.zeros(4096, dtype=torch.uint8, device=device)
    want = src.clone()
    side = torch.cuda.Stream(device)
    handle, src_ptr, dst_ptr = side.cuda_stream, src.data_ptr(), dst.data_ptr()
    torch.cuda.synchronize()

    def receive(block: bool) -> int:
        sock.setblocking(block)
        while True:
            try:
                data = sock.recv(64)
                break
            except BlockingIOError:
                continue
        i, _ = _MSG.unpack(data)
        memcpy_raw([dst_ptr], [src_ptr], [4096], handle)
        while not side.query():
            pass
        return i

    pending: list[Future] = []
    wake = threading.Event()

    def event_thread() -> None:
        while True:
            wake.wait()
            wake.clear()
            f = pending.pop()
            if f is None:
                return
            torch.cuda.set_device(device)
            f.set_result(receive(True))

    th = threading.Thread(target=event_thread, daemon=True)
    th.start()
    ends: dict[int, tuple[str, float]] = {}
    order = list(VARIANTS) + list(VARIANTS)[::-1]
    for i in range(len(VARIANTS) * iters):
        variant = order[i % len(order)]
        dst.zero_()
        torch.cuda.synchronize()
        if variant == "thread":
            f: Future = Future()
            pending.append(f)
            wake.set()
            time.sleep(QUIET_S / 4)  # the event thread is in recv before the owner starts
            ctl["go"].put(i)
            got = f.result(_WAIT)
        else:
            ctl["go"].put(i)
            got = receive(variant == "block")
        ends[i] = (variant, time.perf_counter())
        if got != i or not torch.equal(dst, want):
            raise AssertionError(f"round {i}: got round {got}, bytes equal {torch.equal(dst, want)}")
    pending.append(None)
    wake.set()
    ctl["go"].put(None)
    ctl["go"].put(None)
    return {"ends": ends}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="0,1", help="owner's and reader's GPUs (default 0,1)")
    ap.add_argument("--iters", type=int, default=100, help="rounds per variant")
    args = ap.parse_args()
    own_dev, read_dev = (int(x) for x in args.devices.split(","))
    ctx = _ctx()
    ctl = {"go": ctx.Queue(), "blob": ctx.Queue()}
    tag = f"{time.time_ns()}"
    got = _spawn([(owner, own_dev, len(VARIANTS) * args.iters + 1, ctl, tag), (reader, read_dev, args.iters, ctl, tag)])
    starts, ends = got["owner"][0]["starts"], got["reader"][0]["ends"]
    skip = 10
    print(f"4 KiB hand-off floor, GPU{own_dev} -> GPU{read_dev}, {args.iters} rounds a variant (first {skip} dropped)")
    print(f"{'variant':>8} {'median us':>10} {'p10':>8} {'p90':>8}")
    for variant in VARIANTS:
        lat = [(t - starts[i]) * 1e6 for i, (v, t) in sorted(ends.items()) if v == variant][skip:]
        q = statistics.quantiles(lat, n=10)
        print(f"{variant:>8} {statistics.median(lat):10.1f} {q[0]:8.1f} {q[-1]:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
