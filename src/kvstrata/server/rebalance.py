"""A cluster worker's share of a membership change: its objects copied to the workers that now own their keys, and
its copies of keys it no longer owns dropped once they are there.

Clients route each key to its ``replicas`` owners under the member list they see (:mod:`kvstrata.cluster.placement`).
When the list changes, a key's owners change for about 1/N of the keys: a worker that joins (or comes back empty
under the same node id) owns keys it does not hold, and a worker that died leaves its keys with one copy fewer. A
client finds a key written before one change (it also asks the owners under the list before the change), but not
after two. So each worker, on every change it sees (:class:`Rebalancer`, on the member list's watch), goes over its
objects (:func:`plan_moves`):

- a key it owned before the change and owns still: the first of its old owners that stays writes it to its new
  owners (the others have it too);
- a key it owned before and no longer owns (a worker joined that ranks above it): it writes it to the new owners,
  then drops its own copy;
- a key it did not own before (a stray: written by a client that did not see a change yet, or stood in for a worker
  skipped after a failed connection): it writes it to the key's owners, then drops it, unless it is an owner now.

Writes are write-once (:func:`kvstrata.server.handoff.hand_off`): a value a client already wrote to the new owner
(having seen the change) wins. After a grace period (clients that had not seen the change have sent what they were
sending) it looks again: a key written here since its first look is sent again, overwriting (that write came after
the change began; a client that saw the change may have written the key to its new owner meanwhile: one of the two
concurrent writes wins, as with any two writers of one key); a new stray is sent write-once. Then it drops its
copies that every new owner holds, each only while it is still the version it sent (``ObjectStore.delete`` with
``versions``): never a write that came after.

A newer change while a rebalance runs stops it (nothing dropped); the next one plans from the list the stopped one
was for (clients wrote under it meanwhile) to the newest, so what was sent is found at its owners and what was not
is sent then (as a stray where this worker no longer owns it). A run that failed in part runs again from the same
list, backing off.
Limits: a worker that died with ``replicas=1`` took its keys with it (a drain on planned stops, or ``replicas=2``,
keeps them); a client that saw no change for longer than the grace period (a partition) can still write where the
key no longer belongs: such a stray is found at the next change.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from kvstrata.cluster.placement import Placement
from kvstrata.server.handoff import HandoffReport, Item, hand_off

log = logging.getLogger(__name__)

#: seconds between a rebalance's first look and its second (drops come after it): clients that had not seen the change
#: yet have seen it by then (etcd's watch tells them within milliseconds) and their writes in flight have landed
GRACE_S = 1.0
#: seconds one rebalance may run (a stop or a newer change cuts it short anyway)
DEADLINE_S = 3600.0
#: a rebalance that could not hand everything on (a worker out of reach, one full) runs again after this many seconds,
#: doubling up to RETRY_MAX_S while it keeps failing (what was handed on is found there: an ``exists``, no bytes)
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0


class Move(NamedTuple):
    """One object to hand on: ``targets`` (workers that now own its key and may lack it), and whether this worker's
    copy goes once they hold it (``drop``). ``version``: the one the listing saw. (A NamedTuple: one per object.)"""

    key: str
    ttl: float | None
    version: int
    targets: tuple[str, ...]
    drop: bool
    mode: str = "memory"


def plan_moves(
    listing: Iterable[tuple],
    me: str,
    before: Placement,
    after: Placement,
    replicas: int,
    rejoined: frozenset[str] = frozenset(),
) -> list[Move]:
    """The moves of worker ``me`` for a change of the member list from ``before`` to ``after`` (``rejoined``: workers in
    both that came back, empty, under the same node id), over its objects (``ObjectStore.listing()``)."""
    moves = []
    listing = list(listing)
    staying, listed = frozenset(after.nodes), frozenset(before.nodes)
    union = Placement(staying | listed)  # (one rank per key over both lists, filtered: a third of ranking twice)
    for entry, ranked in zip(listing, union.rank_each(entry[0] for entry in listing)):
        key, ttl, version = entry[:3]
        now = [n for n in ranked if n in staying][:replicas]
        owner_now = me in now
        was = [n for n in ranked if n in listed][:replicas]
        if me in was:
            targets = tuple(n for n in now if n not in was or n in rejoined)
            if owner_now:  # (the others that had it and keep it would send the same: only the first of them does)
                first = next(n for n in was if n in staying and n not in rejoined)
                if first != me:
                    continue
        elif owner_now:  # (a copy here before this worker owned it: its other owners are their old owners' job)
            continue
        else:
            targets = tuple(n for n in now if n != me)
        if targets:
            moves.append(Move(key, ttl, version, targets, not owner_now, entry[3] if len(entry) > 3 else "memory"))
    return moves


def _plan(moves: Iterable[Move]) -> dict[str, list[Item]]:
    plan: dict[str, list[Item]] = defaultdict(list)
    for move in moves:
        for node in move.targets:
            plan[node].append((move.key, move.ttl, move.mode))
    return plan


def rebalance(
    listing: Callable[[], list[tuple]],
    read: Callable[[str], Any],
    drop: Callable[[list[str], list[int]], list[bool]],
    me: str,
    before: Placement,
    after: Placement,
    addresses: Mapping[str, str],
    *,
    replicas: int = 1,
    rejoined: frozenset[str] = frozenset(),
    grace: float = GRACE_S,
    deadline: float | None = None,
    cancelled: threading.Event | None = None,
    name: str = "rebalance",
    token: bytes | None = None,
) -> HandoffReport:
    """Hand on worker ``me``'s objects for a change of the member list from ``before`` to ``after`` (see the module).

    ``listing()``: its objects now (``ObjectStore.listing``); ``read(key)``: a value; ``drop(keys, versions)``: delete
    those keys still at those versions (True per key dropped). ``cancelled``: set to stop (nothing dropped then).
    ``token``: what to answer the other workers' challenges with (their ``--auth-token-file``).
    """
    start = time.monotonic()
    report = HandoffReport()
    deadline = start + DEADLINE_S if deadline is None else deadline
    stop = cancelled or threading.Event()
    first = plan_moves(listing(), me, before, after, replicas, rejoined)
    send: dict[str, Any] = dict(deadline=deadline, name=name, report=report, cancelled=stop.is_set, token=token)
    held = hand_off(_plan(first), read, addresses, **send)
    if stop.wait(grace) or time.monotonic() >= deadline:
        report.seconds = round(time.monotonic() - start, 3)
        return report
    # the second look: keys written here since the first (sent again, overwriting), strays new since (write-once)
    sent = {m.key: m for m in first}
    second = plan_moves(listing(), me, before, after, replicas, rejoined)
    again = [m for m in second if m.key in sent and m.version != sent[m.key].version]
    new = [m for m in second if m.key not in sent]
    held_again = hand_off(_plan(again), read, addresses, overwrite=True, **send)
    held_new = hand_off(_plan(new), read, addresses, **send)
    if not stop.is_set():
        settled = [m for m in second if m.drop and m.key in sent and m.version == sent[m.key].version]
        goes = [m for m in settled if held[m.key] >= len(m.targets)]
        goes += [m for m in again if m.drop and held_again[m.key] >= len(m.targets)]
        goes += [m for m in new if m.drop and held_new[m.key] >= len(m.targets)]
        if goes:
            report.dropped = sum(drop([m.key for m in goes], [m.version for m in goes]))
    report.seconds = round(time.monotonic() - start, 3)
    return report


def _incarnation(member: Any) -> tuple:
    """What tells one run of a worker from the next under the same node id."""
    return (member.address, member.info.get("pid"), member.info.get("started_at"))


class Rebalancer:
    """Runs :func:`rebalance` on a thread of its own for each change of the member list a worker sees.

    ``members``: the list when the worker joined; :meth:`update` is the list's watch callback. The last run's report
    is :attr:`last` (with ``runs``: how many ran, ``running``: whether one runs now).
    """

    def __init__(
        self,
        me: str,
        members: Mapping[str, Any],
        *,
        listing: Callable[[], list[tuple]],
        read: Callable[[str], Any],
        drop: Callable[[list[str], list[int]], list[bool]],
        replicas: int = 1,
        grace: float = GRACE_S,
        token: bytes | None = None,
    ) -> None:
        self.me = me
        self._token = token
        self._listing, self._read, self._drop = listing, read, drop
        self.replicas = replicas
        self.grace = grace
        self._base = dict(members)  # the list the last finished rebalance (or the join) left the objects placed for
        self._latest = dict(members)
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._cancel = threading.Event()  # (the run in progress: a newer change or close() sets it)
        self._closed = False
        self.runs = 0
        self.running = False
        self._seen = self._handled = 0  # (lists told, lists looked at: settled() when equal)
        self.retry_in = 0.0  # seconds to the next try of a rebalance that failed in part (0: none pending)
        self._retry_timer: threading.Timer | None = None
        self.last: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._loop, name=f"kvstrata-rebalance-{me}", daemon=True)
        self._thread.start()

    def update(self, members: Mapping[str, Any]) -> None:
        """A new member list (the watch's callback: returns at once; the work runs on this object's thread)."""
        with self._lock:
            if self._closed or _signature(members) == _signature(self._latest):  # (a watch may repeat a list)
                return
            self._latest = dict(members)
            self._seen += 1
            self._cancel.set()  # (a run in progress is for an older list)
            self._changed.set()

    @property
    def nodes(self) -> list[str]:
        """The node ids of the newest member list this worker was told of."""
        with self._lock:
            return sorted(self._latest)

    def settled(self) -> bool:
        """Whether the objects are handed on for the newest list told (no run in progress or to come)."""
        with self._lock:
            return self._handled == self._seen and not self.running and not self.retry_in

    def wait_settled(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for :meth:`settled`; whether it is."""
        deadline = time.monotonic() + timeout
        while not self.settled():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Stop: a run in progress stops at its next batch, dropping nothing."""
        with self._lock:
            self._closed = True
            self._cancel.set()
            self._changed.set()
            if self._retry_timer is not None:
                self._retry_timer.cancel()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            self._changed.wait()
            with self._lock:
                if self._closed:
                    return
                self._changed.clear()
                self._cancel.clear()
                latest, seen = self._latest, self._seen
                self.running = True
            try:
                self._look(latest)
            finally:
                with self._lock:
                    self._handled, self.running = seen, False

    def _look(self, latest: dict[str, Any]) -> None:
        if self.me not in latest:  # (off the list: its lease ran out, or it is leaving: nothing to hand on here)
            return
        before, after = self._base, latest
        if _signature(before) == _signature(after):
            return
        try:
            report = self._run(before, after)
        except Exception:  # (never the worker: tried again, as a run that failed in part)
            log.exception("rebalance of %s failed", self.me)
            report = None
        if self._cancel.is_set():  # (a newer list, or closing)
            # Clients wrote under ``after`` while this ran: the next run plans from it. What this one did not move yet
            # is found then as copies here this worker does not own under ``after`` (strays: sent to their owners).
            # From the old base, a key written only under ``after`` (say to a worker that died meanwhile, and here)
            # would look unmoved when the newest list equals the old base: its lost copy never made again.
            self._base = after
            return
        if report is not None and not report.failed and not report.left:
            self._base, self.retry_in = after, 0.0
            return
        with self._lock:  # (the base stays: the next try plans the same moves, finds what went, sends the rest)
            if self._closed:
                return
            self.retry_in = min(RETRY_MAX_S, self.retry_in * 2) if self.retry_in else RETRY_FIRST_S
            self._retry_timer = threading.Timer(self.retry_in, self._retry)
            self._retry_timer.daemon = True
            self._retry_timer.start()

    def _retry(self) -> None:
        with self._lock:
            if not self._closed:
                self._seen += 1  # (settled() again once this try is done)
                self._changed.set()

    def _run(self, before: Mapping[str, Any], after: Mapping[str, Any]) -> HandoffReport:
        rejoined = frozenset(
            n for n in after if n in before and n != self.me and _incarnation(before[n]) != _incarnation(after[n])
        )
        report = rebalance(
            self._listing,
            self._read,
            self._drop,
            self.me,
            Placement(before),
            Placement(after),
            {n: m.address for n, m in after.items()},
            replicas=self.replicas,
            rejoined=rejoined,
            grace=self.grace,
            cancelled=self._cancel,
            name=f"rebalance from {self.me}",
            token=self._token,
        )
        self.runs += 1
        self.last = report.as_dict() | {"cancelled": self._cancel.is_set()}
        if report.moved or report.failed or report.dropped or report.left:
            level = logging.WARNING if report.failed else logging.INFO
            log.log(
                level,
                "rebalance after a member list change (%d -> %d workers): %d objects handed on (%d bytes), %d there "
                "already, %d dropped here, %d failed, %d left, in %.2f s%s",
                len(before),
                len(after),
                report.moved,
                report.bytes_moved,
                report.present,
                report.dropped,
                report.failed,
                report.left,
                report.seconds,
                f" ({'; '.join(report.errors[:3])})" if report.errors else "",
            )
        return report


def _signature(members: Mapping[str, Any]) -> dict[str, tuple]:
    return {n: _incarnation(m) for n, m in members.items()}
