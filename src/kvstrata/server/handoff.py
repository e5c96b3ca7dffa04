"""Writing a worker's objects to other workers of its cluster: what a drain (:mod:`kvstrata.server.drain`, a worker
leaving) and a rebalance (:mod:`kvstrata.server.rebalance`, a member list that changed) both do.

:func:`hand_off` speaks the wire protocol through the transport, like any client: per target worker, batch by batch,
an ``exists`` first (a key the target holds already costs no read and no bytes: its value wins, as write-once
would keep it), then ``mput`` of the rest, values of 64 KiB or more as attachments, each key's time to live (what is
left of it) and write mode along (reference counts and a mutable object's state do not: it arrives a plain object).
``overwrite`` sends every listed key and replaces what the target holds (a rebalance's second look, for keys written
here after the change began). It stops at ``deadline`` or once ``cancelled()`` says so; what is left then is
counted, never lost silently, and a target out of reach fails its keys, never the caller.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstrata.errors import KeyExists, KeyNotFound, KvstrataError
from kvstrata.server import protocol as P
from kvstrata.transport import connect
from kvstrata.transport.stream import Attachment, attach

#: most keys and bytes one request of a hand-off carries, and how many requests are in flight to one worker at once
BATCH_KEYS = 256
BATCH_BYTES = 16 << 20
WINDOW = 2
#: reasons kept in a report (the first ones; the counts say how many failed)
ERRORS_KEPT = 10

#: one object to hand on: its key, its seconds left to live (None: no deadline) and its write mode (``memory``,
#: ``write_through``...: it keeps it at its new owner)
Item = tuple[str, float | None, str]


@dataclass
class HandoffReport:
    """What a hand-off did: copies written (``moved``, ``bytes_moved``), copies the target held already (``present``:
    its value kept), copies that could not be written (``failed``; ``errors``: the first few reasons), copies not
    tried before the deadline or a cancel (``left``), and this worker's own copies dropped once handed on
    (``dropped``: a rebalance's keys this worker no longer owns)."""

    moved: int = 0
    present: int = 0
    failed: int = 0
    left: int = 0
    dropped: int = 0
    bytes_moved: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        counts = ("moved", "present", "failed", "left", "dropped", "bytes_moved", "seconds")
        return {k: getattr(self, k) for k in counts} | {"errors": list(self.errors)}

    def note(self, why: str) -> None:
        if len(self.errors) < ERRORS_KEPT:
            self.errors.append(why)


def hand_off(
    plan: Mapping[str, Sequence[Item]],
    read: Callable[[str], Any],
    addresses: Mapping[str, str],
    *,
    deadline: float,
    name: str,
    report: HandoffReport,
    overwrite: bool = False,
    cancelled: Callable[[], bool] | None = None,
    token: bytes | None = None,
) -> Counter[str]:
    """Write the items of ``plan[node]`` to each worker ``node`` (reached at ``addresses[node]``).

    ``read(key)``: the value to send: bytes, or an :class:`~kvstrata.transport.stream.Attachment` (sent straight
    from where it lies, its ``done`` run once sent: a lease on the object, given back) (KeyNotFound where the key
    went meanwhile: skipped, not counted); ``token``: what to answer the targets' challenges with (none: no answer,
    not ``$KVSTRATA_TOKEN``: a worker answers with its own setting);
    ``deadline``: ``time.monotonic()`` after which no batch starts. Counts go into ``report``. Returns per key how
    many of its target workers hold it now (took it, or had it already).
    """
    held: Counter[str] = Counter()
    stop = cancelled or (lambda: False)
    for node, items in plan.items():
        if not items:
            continue
        if time.monotonic() >= deadline or stop():
            report.left += len(items)
            continue
        address = addresses.get(node)
        if address is None:
            report.failed += len(items)
            report.note(f"{node}: not a listed worker")
            continue
        _hand_to(node, address, list(items), read, deadline, name, report, overwrite, stop, held, token)
    return held


def _hand_to(
    node: str,
    address: str,
    items: list[Item],
    read: Callable[[str], Any],
    deadline: float,
    name: str,
    report: HandoffReport,
    overwrite: bool,
    stop: Callable[[], bool],
    held: Counter[str],
    token: bytes | None,
) -> None:
    try:
        wait = max(0.1, min(5.0, deadline - time.monotonic()))
        conn = connect(address, timeout=wait, hello={"shm": False, "name": name}, token=token or b"", cancelled=stop)
    except (KvstrataError, OSError) as exc:
        if stop():  # (called off while it tried: a worker gone, whose departure a newer list shows)
            report.left += len(items)
            return
        report.failed += len(items)
        report.note(f"{node} ({address}): {exc}")
        return
    target = _Target(node, conn, deadline, report, held)
    try:
        for at in range(0, len(items), BATCH_KEYS):
            if time.monotonic() >= deadline or stop():
                report.left += len(items) - at
                return
            chunk = items[at : at + BATCH_KEYS]
            if not overwrite:
                chunk = target.missing(chunk)
            target.send(chunk, read, overwrite)
        target.settle(0)
    finally:
        target.settle(0)  # (a deadline or a cancel between batches: what was sent is still counted)
        conn.close()


class _Target:
    """One target worker's connection, and the counts of what it was sent.

    Up to :data:`WINDOW` ``mput`` requests are in flight at once (replies come in order): the next batch is read
    from the store and sent while the target stores the last one.
    """

    def __init__(self, node: str, conn: Any, deadline: float, report: HandoffReport, held: Counter[str]) -> None:
        self.node, self.conn, self.deadline, self.report, self.held = node, conn, deadline, report, held
        self.pending: deque[list[tuple[str, int]]] = deque()  # (key, bytes) of each mput awaiting its reply
        self.broken = False

    def _failed(self, count: int, exc: BaseException) -> None:
        self.report.failed += count
        self.report.note(f"{self.node}: {exc}")

    def _reply(self, count: int) -> dict[str, Any] | None:
        """The next reply, or None with ``count`` keys counted as failed (and the connection given up on, where it
        failed: later replies could not be told apart)."""
        if self.broken:
            self.report.failed += count
            return None
        try:
            reply, _ = self.conn.recv(timeout=max(1.0, self.deadline - time.monotonic()))
        except (KvstrataError, OSError) as exc:
            self.broken = True
            self._failed(count, exc)
            return None
        if "err" in reply:
            self._failed(count, P.error_from_record(reply["err"]))
            return None
        return reply

    def _send(self, msg: dict[str, Any], count: int) -> bool:
        if self.broken:
            self.report.failed += count
            return False
        try:
            self.conn.send(msg)
        except (KvstrataError, OSError) as exc:
            self.broken = True
            self._failed(count, exc)
            return False
        return True

    def missing(self, items: list[Item]) -> list[Item]:
        """The items the target lacks (those it has are counted as present)."""
        self.settle(0)  # (the exists reply comes after those of the mputs in flight)
        if not self._send({"op": "exists", "keys": [item[0] for item in items]}, len(items)):
            return []
        reply = self._reply(len(items))
        if reply is None:
            return []
        lacking = []
        for item, there in zip(items, reply.get("r", ())):
            if there:
                self.report.present += 1
                self.held[item[0]] += 1
            else:
                lacking.append(item)
        return lacking

    def send(self, items: list[Item], read: Callable[[str], Any], overwrite: bool) -> None:
        """Read and write ``items``: an ``mput`` per time to live and write mode, split at :data:`BATCH_BYTES`."""
        by_ttl: dict[tuple[float | None, str], list[tuple[str, bytes]]] = defaultdict(list)
        nbytes = 0
        for key, ttl, mode in items:
            try:
                value = read(key)
            except KeyNotFound:  # (deleted or expired since the listing)
                continue
            except KvstrataError as exc:
                self.report.failed += 1
                self.report.note(f"{key!r}: {exc}")
                continue
            # a ttl as a whole number of ms: keys of one deadline-ish share a request
            by_ttl[None if ttl is None else max(0.001, round(ttl, 3)), mode].append((key, value))
            nbytes += len(value)
            if nbytes >= BATCH_BYTES:
                self._flush(by_ttl, overwrite)
                nbytes = 0
        self._flush(by_ttl, overwrite)

    def _flush(self, by_ttl: dict[tuple[float | None, str], list[tuple[str, bytes]]], overwrite: bool) -> None:
        for (ttl, mode), pairs in by_ttl.items():
            values = [v if type(v) is Attachment else attach(v) for _, v in pairs]
            msg: dict[str, Any] = {"op": "mput", "items": [[k, v] for (k, _), v in zip(pairs, values)]}
            msg["nx"] = not overwrite
            if ttl is not None:
                msg["ttl"] = ttl
            if mode != "memory":
                msg["mode"] = mode
            if self._send(msg, len(pairs)):
                self.pending.append([(k, len(v)) for k, v in pairs])
                self.settle(WINDOW - 1)
            else:  # (never sent: the leases the values were read under go back)
                for value in values:
                    if type(value) is Attachment:
                        value.release()
        by_ttl.clear()

    def settle(self, keep: int) -> None:
        """Take the replies of the requests in flight until ``keep`` are left."""
        while len(self.pending) > keep:
            sent = self.pending.popleft()
            reply = self._reply(len(sent))
            if reply is None:
                continue
            for (key, size), item in zip(sent, reply.get("items", ())):
                if "err" not in item:
                    self.report.moved += 1
                    self.report.bytes_moved += size
                    self.held[key] += 1
                    continue
                exc = P.error_from_record(item["err"])
                if isinstance(exc, KeyExists):  # (written there between the exists and the mput: it wins)
                    self.report.present += 1
                    self.held[key] += 1
                else:
                    self.report.failed += 1
                    self.report.note(f"{key!r} -> {self.node}: {exc}")
