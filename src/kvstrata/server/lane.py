"""A request lane in shared memory: small requests without a socket round trip, while the worker polls.

A socket round trip between two processes costs ~20 us on a small VM, several times a small
``set``'s own work; handing the request over through memory both processes map costs ~5. Each
session may get one lane: a page pair the worker creates and passes with the handshake. The client
writes one msgpack request into the request area, then its length, then bumps ``req_seq``; the
worker's connection thread, while it busy-polls (:meth:`kvstrata.server.worker.Worker._update_spin`),
sees the new sequence number, copies the request out, handles it like a socket request, writes the
reply and bumps ``rep_seq``. The client busy-polls ``rep_seq``.

The worker advertises that it polls (``polling`` = 1) only while it does; a client sees 0 and uses
the socket. Both sides read that flag without a fence, so a client may hand a request over just as
the worker stops polling: after polling for a while without an answer, it sends a ``lane`` message
on the socket, which the worker always answers (after the lane request it names has been answered),
so a request is never stranded. The order of the stores (bytes, length, then sequence number) is
seen in that order by the other process on x86-64 (TSO); elsewhere the lane is not offered.

The page also carries a device write's *landing* words: a client that sent a ``commit`` with ``"landing"``
before its copies finished stores that request's tag in ``landed`` once its bytes are in host memory (or in
``cancelled`` if the copies failed; a tag there covers every earlier commit too, as tags grow; the worker says
in ``settled`` up to which tag it has read them, and a client writes no word for a new call before that covers
all its earlier ones, so a word is never overwritten before it was read). The worker
answers such a commit at once, and its objects become visible at the moment the word is written: the store
reads the word before any operation (``kvstrata.store.reservations``), so the client's call can return as soon
as it wrote it, with no round trip after its last byte.

Only the ops in :data:`LANE_OPS` travel this way: their replies never carry descriptors and are small.
A client can write anything into the page: the worker copies a request out before decoding it and
checks its length, and a client killed mid-write leaves a request the worker never saw (the
sequence number moves last).
"""

from __future__ import annotations

import ctypes
import platform

from kvstrata.errors import InvalidValue

#: requests that may use a lane (replies without descriptors, a few bytes unless an error)
LANE_OPS = frozenset({"put", "seal", "publish", "abort", "ping"})
HEADER_BYTES = 64
REQUEST_BYTES = (64 << 10) + (8 << 10)  # an inline value (protocol.INLINE_MAX) plus its key and fields
REPLY_BYTES = 8 << 10
LANE_BYTES = HEADER_BYTES + REQUEST_BYTES + REPLY_BYTES
_REQ_SEQ, _REQ_LEN, _REP_SEQ, _REP_LEN, _POLLING, _LANDED, _CANCELLED, _SETTLED = 0, 8, 16, 24, 32, 40, 48, 56


def supported() -> bool:
    """Whether stores made by one process are seen in program order by another without fences (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class Lane:
    """Both ends' view of one lane page (a mapped :class:`~kvstrata.memory.shm.SharedSegment`).

    Not thread-safe: the client's backend lock and the worker's single connection thread guard it.
    """

    def __init__(self, segment: object) -> None:
        self.segment = segment
        base = segment.address  # type: ignore[attr-defined]
        if segment.nbytes < LANE_BYTES:  # type: ignore[attr-defined]
            raise InvalidValue(f"segment: a lane needs {LANE_BYTES} bytes, got {segment.nbytes}")  # type: ignore[attr-defined]
        u64 = ctypes.c_uint64.from_address
        self._req_seq, self._req_len = u64(base + _REQ_SEQ), u64(base + _REQ_LEN)
        self._rep_seq, self._rep_len = u64(base + _REP_SEQ), u64(base + _REP_LEN)
        self._polling = u64(base + _POLLING)
        self._landed, self._cancelled = u64(base + _LANDED), u64(base + _CANCELLED)
        self._settled = u64(base + _SETTLED)
        buf = segment.buffer  # type: ignore[attr-defined]
        self._req = buf[HEADER_BYTES : HEADER_BYTES + REQUEST_BYTES]
        self._rep = buf[HEADER_BYTES + REQUEST_BYTES : LANE_BYTES]
        self.seq = self._req_seq.value  # client: last request sent; worker: last request taken

    # client side ---------------------------------------------------------------------------------
    def polling(self) -> bool:
        return self._polling.value == 1

    def submit(self, payload: bytes) -> int:
        """Hand a request over (``len(payload) <= REQUEST_BYTES``); returns its sequence number."""
        n = len(payload)
        self._req[:n] = payload
        self._req_len.value = n
        self.seq += 1
        self._req_seq.value = self.seq  # last: the worker reads nothing before it sees this
        return self.seq

    def answered(self, seq: int) -> bool:
        return self._rep_seq.value == seq

    def reply(self) -> bytes:
        n = self._rep_len.value
        if n > REPLY_BYTES:
            from kvstrata.errors import ProtocolError

            raise ProtocolError(f"lane reply of {n} bytes, over its {REPLY_BYTES}-byte area")
        return bytes(self._rep[:n])

    def settled(self) -> int:
        """The highest commit tag the worker has read its landing word for (0: none yet). A client writes the
        words of a new call's commits only once every earlier one is read: a word written later (a higher
        tag) would otherwise answer for an earlier commit still waiting, and a cancelled one could pass for
        landed."""
        return self._settled.value

    def land(self, tag: int, ok: bool = True) -> None:
        """Say that the copies of the commit request ``tag`` (sent with ``"landing"``) and of every earlier one
        landed, or that those not landed yet failed. Tags grow: each word only moves forward."""
        (self._landed if ok else self._cancelled).value = tag

    # worker side ---------------------------------------------------------------------------------
    def landing(self, tag: int) -> bool | None:
        """Whether the client said the copies of commit ``tag`` landed (True), failed (False), or not yet (None)."""
        if self._landed.value >= tag:
            return True
        if self._cancelled.value >= tag:
            return False
        return None

    def mark_settled(self, tag: int) -> None:
        """Say that the landing word of commit ``tag`` (and every earlier one) was read (see :meth:`settled`)."""
        if tag > self._settled.value:
            self._settled.value = tag

    def set_polling(self, on: bool) -> None:
        self._polling.value = 1 if on else 0

    def pending(self) -> bool:
        """Whether a request was handed over that the worker has not taken yet."""
        return self._req_seq.value != self.seq

    def take(self) -> bytes:
        """Copy the pending request out (the client could change the page while it is decoded)."""
        seq, n = self._req_seq.value, self._req_len.value
        self.seq = seq
        if n > REQUEST_BYTES:
            from kvstrata.errors import ProtocolError

            raise ProtocolError(f"lane request of {n} bytes, over its {REQUEST_BYTES}-byte area")
        return bytes(self._req[:n])

    def answer(self, payload: bytes) -> None:
        """Write the reply to the request last taken (``len(payload) <= REPLY_BYTES``), then publish it."""
        n = len(payload)
        self._rep[:n] = payload
        self._rep_len.value = n
        self._rep_seq.value = self.seq

    def last_answered(self) -> int:
        return self._rep_seq.value

    def close(self) -> None:
        self._req_seq = self._req_len = self._rep_seq = self._rep_len = self._polling = None  # type: ignore[assignment]
        self._landed = self._cancelled = self._settled = None  # type: ignore[assignment]
        self._req.release()
        self._rep.release()
        self.segment.close()  # type: ignore[attr-defined]
