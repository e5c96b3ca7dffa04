"""``kvstrata status``: what the node's worker holds (tiers, objects, hits, misses, evictions, spills, clients)."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

from kvstrata.errors import InvalidArgument, KvstrataError

#: clients the summary names one by one
CLIENTS_SHOWN = 10


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("status", help="show the node worker's tiers, objects, hit rate and clients")
    p.add_argument("--address", help="worker address (default: $KVSTRATA_WORKER or the default socket)")
    p.add_argument(
        "--cluster",
        help="show every worker of this cluster (etcd://HOST:PORT/NAME, or etcds:// over TLS: see kvstrata worker "
        "--help), a line each, and the totals",
    )
    p.add_argument("--prometheus", action="store_true", help="print metrics in the Prometheus text format")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the worker (default 2)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvstrata.server.metrics import to_prometheus

    if not math.isfinite(args.timeout) or args.timeout <= 0:
        print(
            f"kvstrata status: --timeout: seconds to wait for the worker, a number > 0, got {args.timeout}",
            file=sys.stderr,
        )
        return 2
    if args.cluster is not None:
        if args.address is not None or args.prometheus:
            print("kvstrata status: --cluster shows every worker: drop --address and --prometheus", file=sys.stderr)
            return 2
        return run_cluster(args.cluster, timeout=args.timeout)
    try:
        # --prometheus: what a scraper sees at the worker's /metrics, where this command is no client
        stats, address = fetch_stats(args.address, timeout=args.timeout, leave_out_self=args.prometheus)
    except InvalidArgument as exc:  # (an empty --address, say): nothing to wait for
        print(f"kvstrata status: {exc}", file=sys.stderr)
        return 2
    except KvstrataError as exc:
        print(f"kvstrata status: no worker reachable: {exc}", file=sys.stderr)
        return 1
    if args.prometheus:
        sys.stdout.write(to_prometheus(stats))
    else:
        print(render(stats, address))
    return 0


def run_cluster(url: str, *, timeout: float) -> int:
    """``kvstrata status --cluster URL``: each listed worker's line (its stats read over TCP), then the totals.
    Exit status 1 when etcd can't be reached or a listed worker does not answer, 2 for a malformed address."""
    from kvstrata.cluster import open_membership

    try:
        with open_membership(url, timeout=timeout) as membership:
            members = membership.members()
    except (InvalidArgument, ValueError) as exc:
        print(f"kvstrata status: {exc}", file=sys.stderr)
        return 2
    except (KvstrataError, ImportError) as exc:
        print(f"kvstrata status: {exc}", file=sys.stderr)
        return 1
    stats: dict[str, dict[str, Any] | str] = {}
    for node, member in sorted(members.items()):
        try:
            stats[node] = fetch_stats(member.address, timeout=timeout, leave_out_self=True)[0]
        except KvstrataError as exc:
            stats[node] = str(exc)
    print(render_cluster(url, members, stats))
    return 1 if any(isinstance(s, str) for s in stats.values()) else 0


def render_cluster(url: str, members: dict[str, Any], stats: dict[str, dict[str, Any] | str]) -> str:
    """A line per worker of a cluster (memory tier use, objects, clients; or why it did not answer), then totals."""
    from kvstrata.units import format_size

    lines = [f"cluster {url}: {len(members)} workers listed"]
    totals = {"used": 0, "capacity": 0, "objects": 0}
    for node, s in stats.items():
        member = members[node]
        if isinstance(s, str):
            lines.append(f"  {node:<24} {member.address:<28} NOT ANSWERING: {s}")
            continue
        memory = s.get("tiers", {}).get("memory", {})
        used, cap = memory.get("used", 0), memory.get("capacity", 0)
        totals["used"] += used
        totals["capacity"] += cap
        totals["objects"] += s.get("objects", 0)
        lines.append(
            f"  {node:<24} {member.address:<28} memory {format_size(used):>10} of {format_size(cap):>10}   "
            f"objects {s.get('objects', 0):>8}   clients {s.get('clients', 0):>3}   "
            f"up {s.get('uptime_seconds', 0):.0f} s{_rebalance_note(s)}"
        )
    if members:
        lines.append(
            f"  total: memory {format_size(totals['used'])} of {format_size(totals['capacity'])}, "
            f"{totals['objects']} objects"
        )
    else:
        lines.append("  (no worker has joined: start one with kvstrata worker --cluster " + url + ")")
    return "\n".join(lines)


def _rebalance_note(stats: dict[str, Any]) -> str:
    """What the worker's last rebalance did (kvstrata.server.rebalance), where it ran one, and how many writes routed
    by an out-of-date member list it refused, where any: '' where neither."""
    cluster = stats.get("cluster") or {}
    rebalance = cluster.get("rebalance") or {}
    last = rebalance.get("last")
    stale = cluster.get("stale_writes_refused")
    tail = f"   {stale} stale write{'s' * (stale != 1)} refused" if stale else ""
    if rebalance.get("running"):
        return "   rebalancing" + tail
    if not last:
        return tail
    note = f"   last rebalance: {last.get('moved', 0)} handed on, {last.get('dropped', 0)} dropped"
    if last.get("failed") or last.get("left"):
        note += f", {last.get('failed', 0)} failed, {last.get('left', 0)} left"
    if rebalance.get("retry_in_s"):
        note += f" (tried again within {rebalance['retry_in_s']:g} s)"
    return note + tail


def fetch_stats(
    address: str | None = None, *, timeout: float = 2.0, leave_out_self: bool = False
) -> tuple[dict[str, Any], str]:
    """The worker's stats and its address, through a bare connection: no shared memory is mapped and the
    client SDK (with torch) is not imported, so the command answers in a fraction of a second.

    ``timeout`` bounds the connection, the handshake and the stats together. The stats count and list this
    command's own connection among the clients, unless ``leave_out_self`` (see :func:`without_self`).
    """
    from kvstrata.errors import Timeout
    from kvstrata.server import protocol as P
    from kvstrata.server.config import worker_address
    from kvstrata.transport import connect

    address = worker_address(address)
    deadline = time.monotonic() + timeout
    with connect(address, timeout=timeout, hello={"shm": False, "name": "kvstrata status"}) as conn:
        conn.send({"op": "stats"})
        try:  # (a handshake that took it all still gets a moment: the reply may be there already)
            reply, fds = conn.recv(timeout=max(deadline - time.monotonic(), 0.001))
        except Timeout:
            raise Timeout(f"the worker at {address} did not send its stats within {timeout:g} s") from None
        for fd in fds:  # none are sent for this request; never leak one if a worker does
            os.close(fd)
        conn.send({"op": "bye"})  # a clean close: the worker's log would call an unannounced one a crash
    if "err" in reply:
        raise P.error_from_record(reply["err"])
    stats = reply["stats"]
    return (without_self(stats, reply.get("asker")) if leave_out_self else stats), address


def without_self(stats: dict[str, Any], asker: dict[str, Any] | None = None) -> dict[str, Any]:
    """``stats`` with the connection that asked for them taken out of the clients.

    ``asker`` is that connection as the worker's stats reply describes it (name, pid, whether ``clients``
    counts it): it is taken out of the count even where the client list, cut short by the worker, does not name it.
    None (a worker that does not describe it): the connections listed with this process's pid are taken out.
    """
    listed = stats.get("client_list") or []
    if asker is None:
        mine = [c for c in listed if isinstance(c, dict) and c.get("pid") == os.getpid()]
        counted = len(mine)
    elif asker.get("counted"):
        me = (asker.get("name"), asker.get("pid"))
        mine = [c for c in listed if isinstance(c, dict) and (c.get("name"), c.get("pid")) == me][:1]
        counted = 1
    else:  # (a device-object link's connection: not counted as a client)
        return stats
    if not counted:
        return stats
    return {
        **stats,
        "clients": max(0, stats.get("clients", 0) - counted),
        "client_list": [c for c in listed if not any(c is m for m in mine)],
    }


def render(stats: dict[str, Any], address: str) -> str:
    """A human summary of a worker's stats."""
    from kvstrata.units import format_size

    up, clients = stats.get("uptime_seconds", 0), stats.get("clients", 0)
    lines = [f"worker at {address}  (up {up:.0f} s, {clients} clients, this one included)"]
    for tier, t in stats.get("tiers", {}).items():
        used, cap = t.get("used", 0), t.get("capacity", 0)
        pct = 100 * used / cap if cap else 0
        line = f"  {tier:<7} {format_size(used):>10} of {format_size(cap):>10} used ({pct:4.1f}%)"
        if t.get("retired_segments"):  # emptied to map values larger than a segment
            line += f", {t['retired_segments']} segments retired"
        lines.append(line)
    hits, misses = stats.get("hits", 0), stats.get("misses", 0)
    rate = 100 * hits / (hits + misses) if hits + misses else 0
    local = stats.get("local_hits", 0)
    lines.append(
        f"  objects {stats.get('objects', 0)}   hits {hits} ({local} served by the clients from shared memory)   "
        f"misses {misses}   (hit rate {rate:.1f}%)"
    )
    lines.append(
        "  evictions {}   spills {}   promotions {}   expired {}   corrupt {}   write-back pending {}".format(
            *(stats.get(k, 0) for k in ("evictions", "spills", "promotions", "expired", "corrupt", "dirty"))
        )
    )
    lines.append(f"  requests {stats.get('requests', 0)}   refused {stats.get('request_errors', 0)}")
    listed = stats.get("client_list") or []
    for c in listed[:CLIENTS_SHOWN]:
        lines.append(
            f"  client {c.get('name')}: connected {c.get('connected_seconds', 0):.0f} s, "
            f"{c.get('leases', 0)} leases held, {c.get('open_writes', 0)} writes open"
        )
    if clients > min(len(listed), CLIENTS_SHOWN):
        lines.append(f"  ... and {clients - min(len(listed), CLIENTS_SHOWN)} more clients")
    if stats.get("lane_requests_polled"):  # several clients' small requests
        lines.append(f"  small requests answered by the worker's polling thread {stats['lane_requests_polled']}")
    d = stats.get("device_objects")
    if d:
        lines.append(
            f"  device objects {d.get('objects', 0)} ({d.get('waiters', 0)} receives waiting, "
            f"{d.get('transfers', 0)} copies in flight)   published {d.get('published', 0)}   "
            f"received {d.get('received', 0)}   reads {d.get('reads', 0)}   timeouts {d.get('timeouts', 0)}"
        )
        lines.append(
            "  offers whose publish came after their receive stopped waiting: "
            f"taken {d.get('offer_fates_taken', 0)}, not taken {d.get('offer_fates_not_taken', 0)}"
        )
    return "\n".join(lines)
