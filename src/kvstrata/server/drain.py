"""A cluster worker's hand-off as it leaves: its objects written to the workers that own their keys once it is gone.

A worker that stops on purpose (a rolling restart, a scale-down) would otherwise take its keys with it: after it
leaves the member list, clients route each of its keys to the next worker in the key's rendezvous order
(:mod:`kvstrata.cluster.placement`), which does not have it. :func:`drain` writes each object to that worker, the
key's first owner among the workers that stay, write-once (``nx``): a newer value a client already wrote there wins.
With ``replicas=R`` clients, the key's other R-1 owners are unchanged by one worker leaving, so the first owner is
the one place a key may be missing.

Limit: "already there" is all it can tell; the cluster keeps no write times. Where the heir holds an older copy
(the key's owner before a join moved the key here, a copy writes through this worker never replaced, since clients
write to the owners they see now), that older copy stays and this worker's newer one is dropped: as if there had been
no drain. Overwriting instead would clobber what clients write to the heir once they see this worker gone, during
the hand-off. (A write time per object, last writer wins, would settle both: not built.)

It runs after the worker left the list and stopped serving its clients, so every write it acknowledged is in the
store and none comes after the snapshot of keys it hands over. It speaks the wire protocol through the transport
(``mput`` requests, values of 64 KiB or more as attachments), batch by batch, until ``deadline``; what is left then
is counted, not lost silently. Expired keys are skipped; a key's time to live goes with it (what was left of it).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvstrata.errors import KeyExists, KeyNotFound, KvstrataError
from kvstrata.server import protocol as P
from kvstrata.transport import connect
from kvstrata.transport.stream import attach

log = logging.getLogger(__name__)

#: most keys and bytes one ``mput`` of the hand-off carries
BATCH_KEYS = 256
BATCH_BYTES = 64 << 20


@dataclass
class DrainReport:
    """What :func:`drain` did: keys written to their new owners, keys those already held (a newer write won), keys
    that could not be written (``errors``: the first few reasons), and keys left when the deadline came."""

    moved: int = 0
    present: int = 0
    failed: int = 0
    left: int = 0
    bytes_moved: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("moved", "present", "failed", "left", "bytes_moved", "seconds")} | {
            "errors": list(self.errors)
        }


def drain(
    listing: Iterable[tuple[str, float | None]],
    read: Callable[[str], bytes],
    owner_of: Callable[[str], str | None],
    addresses: dict[str, str],
    *,
    deadline: float,
    name: str = "drain",
) -> DrainReport:
    """Write each listed object to the worker ``owner_of(key)`` names (its address in ``addresses``).

    ``listing``: ``(key, seconds left to live or None)`` per object; ``read(key)``: its bytes (KeyNotFound where it
    went meanwhile: skipped); ``deadline``: ``time.monotonic()`` after which no batch starts (the rest counted as
    ``left``). A worker that cannot be reached or fails a batch has that batch counted as ``failed``.
    """
    start = time.monotonic()
    report = DrainReport()
    by_owner: dict[str, list[tuple[str, float | None]]] = defaultdict(list)
    for key, ttl in listing:
        node = owner_of(key)
        if node is None or node not in addresses:
            report.failed += 1
            _note(report, f"{key!r}: no worker to take it")
            continue
        by_owner[node].append((key, ttl))
    for node, items in by_owner.items():
        if time.monotonic() >= deadline:
            report.left += len(items)
            continue
        _drain_to(node, addresses[node], items, read, deadline, name, report)
    report.seconds = round(time.monotonic() - start, 3)
    return report


def _drain_to(
    node: str,
    address: str,
    items: list[tuple[str, float | None]],
    read: Callable[[str], bytes],
    deadline: float,
    name: str,
    report: DrainReport,
) -> None:
    try:
        wait = max(0.1, min(5.0, deadline - time.monotonic()))
        conn = connect(address, timeout=wait, hello={"shm": False, "name": name})
    except (KvstrataError, OSError) as exc:
        report.failed += len(items)
        _note(report, f"{node} ({address}): {exc}")
        return
    try:
        at = 0
        while at < len(items):
            if time.monotonic() >= deadline:
                report.left += len(items) - at
                return
            batch, at = _next_batch(items, at, read, report)
            for ttl, pairs in batch.items():
                _send(conn, node, pairs, ttl, deadline, report)
    finally:
        conn.close()


def _next_batch(
    items: list[tuple[str, float | None]], at: int, read: Callable[[str], bytes], report: DrainReport
) -> tuple[dict[float | None, list[tuple[str, bytes]]], int]:
    """The next batch's values (read now), grouped by time to live, and where the batch after it starts."""
    batch: dict[float | None, list[tuple[str, bytes]]] = defaultdict(list)
    keys = nbytes = 0
    while at < len(items) and keys < BATCH_KEYS and nbytes < BATCH_BYTES:
        key, ttl = items[at]
        at += 1
        try:
            value = read(key)
        except KeyNotFound:  # (deleted or expired since the listing)
            continue
        except KvstrataError as exc:
            report.failed += 1
            _note(report, f"{key!r}: {exc}")
            continue
        # a ttl as a whole number of ms: keys of one deadline-ish share a request
        batch[None if ttl is None else max(0.001, round(ttl, 3))].append((key, value))
        keys += 1
        nbytes += len(value)
    return batch, at


def _send(conn: Any, node: str, pairs: list[tuple[str, bytes]], ttl: float | None, deadline: float, report) -> None:
    msg: dict[str, Any] = {"op": "mput", "items": [[k, attach(v)] for k, v in pairs], "nx": True}
    if ttl is not None:
        msg["ttl"] = ttl
    try:
        conn.send(msg)
        reply, _ = conn.recv(timeout=max(1.0, deadline - time.monotonic()))
    except (KvstrataError, OSError) as exc:
        report.failed += len(pairs)
        _note(report, f"{node}: {exc}")
        return
    if "err" in reply:
        report.failed += len(pairs)
        _note(report, f"{node}: {P.error_from_record(reply['err'])}")
        return
    for (key, value), item in zip(pairs, reply.get("items", ())):
        if "err" not in item:
            report.moved += 1
            report.bytes_moved += len(value)
            continue
        exc = P.error_from_record(item["err"])
        if isinstance(exc, KeyExists):
            report.present += 1
        else:
            report.failed += 1
            _note(report, f"{key!r} -> {node}: {exc}")


def _note(report: DrainReport, why: str) -> None:
    if len(report.errors) < 10:
        report.errors.append(why)
