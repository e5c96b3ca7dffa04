"""The 4 KiB hand-off with and without direct offers (kvstrata.devobj.offers), switched round by round in one pair
of processes (so both variants see the same host speed), isolated and back to back, subscriber first.

Isolated: each side idle ``QUIET_S`` and the previous hand-off over on both sides (the owner's release
included) before the next; back to back: the next subscribe as soon as the reader has its bytes. End to end:
the owner's publish call to the reader's future done (one monotonic clock for the node). Variants go in the
order on, off, off, on, ... so neither always runs first. ``--trace`` prints the median per step of the
isolated rounds per variant (``KVSTRATA_DEVOBJ_TRACE=1`` in the children). Variants: ``on`` (the publisher
offers, the default) and ``off`` (no offers: the broker's match alone); and, to tell the host's share of an
isolated hand-off from kvstrata's (offers on in each): ``owarm`` (the owner busy-waits its quiet time instead of
sleeping, so its core never idles), ``rhot`` (the reader's leading waiter polls up to 20 ms instead of its
default budget, so it is still polling when the offer comes) and ``hot`` (both).

    PYTHONPATH=src python3 tools/probe_handoff.py [--devices 0,0] [--iters 200] [--variants on,off] [--trace]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvstrata.bench._procs import device_client
from kvstrata.bench.device import QUIET_S, _ctx, _get, _pattern, _spawn, _wait

MODES = ("isolated", "back to back")
#: on: the publisher offers (the default); off: no offers; owarm / rhot / hot: on, with the owner's core kept busy
#: through its quiet time / the reader polling until the offer comes / both (see the module's docstring)
VARIANTS = ("on", "off", "owarm", "rhot", "hot")
_OWNER_WARM = ("owarm", "hot")
_READER_HOT = ("rhot", "hot")
#: the reader's leading-waiter polling budget in the rhot / hot variants (seconds)
_HOT_SPIN_S = 0.02


def _busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def owner(address: str, device: int, rounds: int, ctl: dict) -> dict:
    import torch

    from kvstrata.devobj import debug

    c = device_client(address, device)
    dev = c.device_objects()
    src = _pattern(4096, device)
    torch.cuda.synchronize()
    t_pub, traces = {}, {}
    prev = None
    for _ in range(rounds):
        i, mode, variant = _get(ctl["req"], "owner: next hand-off")
        if mode == "isolated" and prev is not None:
            _wait(prev, f"owner: release of h/{i - 1}")
            if variant in _OWNER_WARM:
                _busy_wait(QUIET_S)
            else:
                time.sleep(QUIET_S)
        dev.send_offers = variant != "off"
        debug.trace_take()
        t_pub[i] = time.perf_counter()
        (prev,) = c.dev_publish([f"h/{i}"], [[src]])
        traces[i] = [(t, f"owner {th}", step) for t, th, step in debug.trace_take()]
    _wait(prev, "owner: release of the last hand-off")
    if not ctl["done"].wait(600):
        raise RuntimeError("owner: the reader did not finish")
    out = {"t_pub": t_pub, "traces": traces, "sent": dev._offer_box.sent if dev._offer_box else 0}
    c.close()
    return out


def reader(address: str, device: int, iters: int, variants: list[str], ctl: dict) -> dict:
    import torch

    from kvstrata.devobj import debug

    c = device_client(address, device)
    dev = c.device_objects()
    d = torch.zeros(4096, dtype=torch.uint8, device=device)
    want = _pattern(4096, device)
    done, traces = {}, {}
    spin = dev._lead_spin
    i = 0
    for mode in MODES:
        order = variants + variants[::-1]  # a, b, c, c, b, a: no variant always first
        for k in range(len(variants) * iters):
            variant = order[k % len(order)]
            if mode == "isolated":
                time.sleep(QUIET_S)
            d.zero_()
            dev._lead_spin = _HOT_SPIN_S if variant in _READER_HOT else spin
            (f,) = c.dev_subscribe([f"h/{i}"], [[d]], timeout=600)
            debug.trace_take()
            ctl["req"].put((i, mode, variant))
            _wait(f, f"reader: h/{i}")
            done[i] = (mode, variant, time.perf_counter())
            traces[i] = [(t, f"reader {th}", step) for t, th, step in debug.trace_take()]
            traces[i].append((done[i][2], "reader main", "future done"))
            if not torch.equal(d, want):
                raise AssertionError(f"h/{i}: wrong bytes")
            i += 1
    ctl["done"].set()
    out = {"done": done, "traces": traces, "taken": dev.offers_taken, "used": dev.offers_used}
    c.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="0,0", help="owner's and reader's GPUs (default 0,0)")
    ap.add_argument("--iters", type=int, default=200, help="hand-offs per variant and mode")
    ap.add_argument("--variants", default="on,off", help=f"comma-separated, of {', '.join(VARIANTS)} (default on,off)")
    ap.add_argument("--trace", action="store_true", help="median per step of the isolated rounds, per variant")
    args = ap.parse_args()
    from kvstrata.devobj import debug

    if args.trace:
        os.environ["KVSTRATA_DEVOBJ_TRACE"] = "1"  # the spawned children read it at import
        debug.TRACING = True  # and the worker, hosted here
    from kvstrata.server.config import WorkerConfig
    from kvstrata.server.worker import Worker

    own_dev, read_dev = (int(x) for x in args.devices.split(","))
    variants = args.variants.split(",")
    if not variants or any(v not in VARIANTS for v in variants):
        ap.error(f"--variants: of {', '.join(VARIANTS)}")
    rounds = len(MODES) * len(variants) * args.iters
    with tempfile.TemporaryDirectory() as tmp:
        # KVSTRATA_SPIN_US, as for `kvstrata worker` and bench device: how long connection threads poll (0: never)
        spin = float(os.environ.get("KVSTRATA_SPIN_US", WorkerConfig.spin_us))
        config = WorkerConfig(socket=str(Path(tmp) / "kv.sock"), memory=64 << 20, disk_dir="", spin_us=spin)
        worker = Worker(config).start()
        try:
            ctx = _ctx()
            ctl = {"req": ctx.Queue(), "done": ctx.Event()}
            got = _spawn(
                [
                    (owner, worker.address, own_dev, rounds, ctl),
                    (reader, worker.address, read_dev, args.iters, variants, ctl),
                ]
            )
        finally:
            worker.stop()
    own, rd = got["owner"][0], got["reader"][0]
    if args.trace:  # the worker's stamps go to the round whose window (publish call .. future done) holds them
        windows = sorted((own["t_pub"][i], t, i) for i, (_, _, t) in rd["done"].items())
        for t, th, step in debug.trace_take():
            for start, end, i in windows:
                if start <= t <= end:
                    rd["traces"][i].append((t, f"worker {th}", step))
                    break
    skip = 10  # per (mode, variant): warm-up
    print(f"4 KiB hand-off, GPU{own_dev} -> GPU{read_dev}, {args.iters} per variant and mode (first {skip} dropped)")
    print(f"offers sent {own['sent']}, copied by the reader {rd['taken']}, used {rd['used']}")
    print(f"{'mode':>14} {'offers':>7} {'median us':>10} {'p10':>8} {'p90':>8}")
    for mode in MODES:
        for variant in variants:
            lat = [
                (t - own["t_pub"][i]) * 1e6 for i, (m, v, t) in sorted(rd["done"].items()) if m == mode and v == variant
            ][skip:]
            q = statistics.quantiles(lat, n=10)
            print(f"{mode:>14} {variant:>7} {statistics.median(lat):10.1f} {q[0]:8.1f} {q[-1]:8.1f}")
    if args.trace:
        for variant in variants:
            rounds_ = [
                own["traces"][i] + rd["traces"][i]
                for i, (m, v, _) in sorted(rd["done"].items())
                if m == "isolated" and v == variant
            ][skip:]
            print(f"--- median per step, isolated, variant {variant} (from the publish call)")
            print(debug.trace_medians(rounds_))
    return 0


if __name__ == "__main__":
    sys.exit(main())
