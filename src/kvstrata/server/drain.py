"""A cluster worker's hand-off as it leaves: its objects written to the workers that own their keys once it is gone.

A worker that stops on purpose (a rolling restart, a scale-down) would otherwise take its keys with it: after it
leaves the member list, clients route each of its keys to the next worker in the key's rendezvous order
(:mod:`kvstrata.cluster.placement`), which does not have it. :func:`drain` writes each object to the workers that own
its key without this one and did not with it (with ``replicas=R``, the key's other R-1 owners are unchanged by one
worker leaving: the one that moves up into the R is the one place a key may be missing), write-once: a value a
client already wrote there wins (:func:`kvstrata.server.handoff.hand_off`).

Limit: "already there" is all it can tell; the cluster keeps no write times. Where the heir holds an older copy
(a copy writes through this worker never replaced, since clients write to the owners they see now), that older copy
stays and this worker's newer one is dropped: as if there had been no drain. Overwriting instead would clobber what
clients write to the heir once they see this worker gone, during the hand-off. A rebalance
(:mod:`kvstrata.server.rebalance`) drops the copies a worker no longer owns after each change, so such older copies
are rare. (A write time per object, last writer wins, would settle it: not built.)

It runs after the worker left the list and stopped serving its clients, so every write it acknowledged is in the
store and none comes after the snapshot of keys it hands over. Batch by batch until ``deadline``: what is left then
is counted, not lost silently. Expired keys are skipped; a key's time to live (what was left of it) and write mode
go with it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvstrata.server.handoff import HandoffReport, Item, hand_off

#: what a drain did (the counts of :class:`~kvstrata.server.handoff.HandoffReport`)
DrainReport = HandoffReport


def drain(
    listing: Iterable[tuple],
    read: Callable[[str], Any],
    targets_of: Callable[[str], Sequence[str]],
    addresses: Mapping[str, str],
    *,
    deadline: float,
    name: str = "drain",
    token: bytes | None = None,
) -> DrainReport:
    """Write each listed object to the workers ``targets_of(key)`` names (their addresses in ``addresses``).

    ``listing``: ``(key, seconds left to live or None[, version, write mode])`` per object (as
    ``ObjectStore.listing`` gives them; the write mode goes along, default ``memory``);
    ``read(key)``: its bytes (KeyNotFound where it went meanwhile: skipped); ``deadline``: ``time.monotonic()`` after
    which no batch starts (the rest counted as ``left``). A worker that cannot be reached or fails a batch has that
    batch counted as ``failed``, and so has a key with no worker to take it. ``token``: what to answer the other
    workers' challenges with (their ``--auth-token-file``).
    """
    start = time.monotonic()
    report = DrainReport()
    plan: dict[str, list[Item]] = defaultdict(list)
    for key, ttl, *rest in listing:
        mode = rest[1] if len(rest) > 1 else "memory"
        targets = [node for node in targets_of(key) if node in addresses]
        if not targets:
            report.failed += 1
            report.note(f"{key!r}: no worker to take it")
        for node in targets:
            plan[node].append((key, ttl, mode))
    hand_off(plan, read, addresses, deadline=deadline, name=name, report=report, token=token)
    report.seconds = round(time.monotonic() - start, 3)
    return report
