"""Direct offers: a publisher tells a waiting subscriber about its object itself, beside the broker.

The 4 KiB hand-off's longest step is the broker's hop: a publish reaches the worker, which wakes, matches
and pushes the ``matched`` event to the subscriber, which wakes in turn (two cross-process wake-ups, each
tens of microseconds on the H200 hosts, before the subscriber can start its copy). An offer takes that hop
off the hand-off's path:

* The broker keeps, in shared memory, a hint per key with a subscriber waiting and no object yet: the
  first waiter's receive id and client id (:class:`OfferTable`, written under the broker's lock, read
  by every client of the node with no lock; a seqlock per slot).
* A publisher that finds a hint for a key it publishes sends that subscriber an *offer* (the record it
  registers) as a datagram (:class:`OfferBox`, an abstract Unix socket per client), then registers the
  object with the broker, saying whom it offered it to.
* The subscriber takes the offer if that receive still waits, matches the record's tensors and is small:
  it copies from the offered export at once, and once the copy ended with the export's owner alive, the
  receive is done. The broker's hop is off the hand-off's path.
* The broker reconciles (:mod:`kvstrata.devobj.broker_offers`). A publish says whom its offer went to
  (``offered``):

  - where that receive still waits first in line, the broker matches the two as usual, and the match only
    confirms what the receive took;
  - a receive that took an offer hands any *other* object matched with it back to the broker, whole, for
    the next receive;
  - where the receive no longer waits (it timed out, was matched with another object, cancelled) or waits
    behind the key's other object, the broker holds the publish, asks that client whether it took the
    offer (``offer_fate``), and then marks the object received or gives it to the next receive (a publish
    held aside because its key had another object fails with ``KeyExists`` unless it was taken);
  - a client leaving says which offers it took whose match it has not seen (``goodbye``), so an object
    taken is never delivered twice, and its publisher is released.

  Whatever the order of offers, publishes, timeouts and matches, each object goes to one receive, and a
  receive gets each byte of one object. An offer is trusted as its publish is: it comes from a process of
  the same user, who could connect to the worker as any of its clients anyway.

Offers are a same-node path between processes of one user: the socket takes datagrams only from
processes of this user (``SO_PASSCRED``), and clients of other network namespaces simply never
receive them. ``KVSTRATA_DEVOBJ_OFFERS=0`` turns them off (the broker alone).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import operator
import os
import socket
import struct
from typing import Any

import msgpack

from kvstrata.errors import InvalidValue

log = logging.getLogger(__name__)

#: hint slots in the table, and bytes per slot: ``seq``, ``key hash``, ``wid`` (8 bytes each), then the
#: client id (a length byte and up to :data:`CID_MAX` bytes)
SLOTS = 4096
SLOT_BYTES = 64
CID_MAX = SLOT_BYTES - 25
TABLE_BYTES = SLOTS * SLOT_BYTES
#: a publish of more keys than this sends no offers (the lookups would cost more than they save: the offer
#: path is for small hand-offs, whose time is the host's)
OFFER_MAX_KEYS = 8
#: an offer datagram larger than this is not sent (a record of many tensors: the broker's path carries it)
DATAGRAM_MAX = 16 << 10
_ADDRESS_PREFIX = b"\0kvstrata-devobj/"
_UCRED = struct.Struct("3i")  # pid, uid, gid
_CMSG_SPACE = socket.CMSG_SPACE(_UCRED.size)
#: record fields that differ between offers of one buffer (sent beside its packed shared fields)
_PER_OFFER = frozenset(("key", "local", "offered"))
#: a publisher's item's fields that offers of one buffer share, those compared by identity first
_SHARED_GET = operator.itemgetter("tensors", "handles", "events", "device", "node_id", "pid", "transport", "owner")
#: packed / unpacked shared fields kept per box (the oldest dropped beyond this)
_CACHE_MAX = 1024


def offers_enabled() -> bool:
    """Whether publishers send and subscribers take offers: ``KVSTRATA_DEVOBJ_OFFERS=0`` turns them off."""
    return os.environ.get("KVSTRATA_DEVOBJ_OFFERS", "1").strip().lower() not in ("0", "off", "false", "no")


@functools.lru_cache(maxsize=1 << 16)
def key_hash(key: str) -> int:
    """A 64-bit hash of ``key``, the same in every process (Python's ``hash`` of a str is not), never 0 (kept
    for the keys seen last: the broker hashes a key as its waiters come and go, a publisher as it publishes)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") or 1


def export_id(rec: dict[str, Any]) -> tuple:
    """What names one export of a publisher in a record or offer: its owner, process and export token."""
    return (rec.get("owner"), rec.get("pid"), rec.get("local"))


class OfferTable:
    """Hints of waiting subscribers, in ``buffer`` (:data:`TABLE_BYTES` bytes, shared memory).

    One writer (the broker, under its lock) and any number of readers, in any process. A slot holds one
    key's hint (``key_hash % SLOTS``); a key whose slot another key holds gets no hint (hints are optional).
    A writer makes ``seq`` odd, writes the fields, makes it even again; a reader takes the slot only if
    ``seq`` was even and unchanged around its reads. (Stores and loads of the aligned 8-byte words keep
    their order between processes on x86-64 and are checked again by the subscriber: see the module.)
    """

    def __init__(self, buffer: Any) -> None:
        view = memoryview(buffer)
        if view.nbytes < TABLE_BYTES:
            raise InvalidValue(f"buffer: the offer table needs {TABLE_BYTES} bytes, got {view.nbytes}")
        self._bytes = view[:TABLE_BYTES].cast("B")
        self._words = self._bytes.cast("Q")
        self._held: dict[int, str] = {}  # writer side: slot -> the key whose hint it holds
        self._keys: set[str] = set()  # writer side: the keys with a hint (clearing any other costs nothing)

    # -- the broker's side ------------------------------------------------------------------------
    def put(self, key: str, wid: int, client: str) -> bool:
        """Hint that receive ``wid`` of ``client`` waits for ``key``; False when the slot is another key's or
        the client id does not fit (no hint then)."""
        cid = client.encode()
        h = key_hash(key)
        slot = h % SLOTS
        holder = self._held.get(slot)
        if (holder is not None and holder != key) or len(cid) > CID_MAX:
            return False
        self._held[slot] = key
        self._keys.add(key)
        w, b = self._words, self._bytes
        base = slot * (SLOT_BYTES // 8)
        w[base] += 1  # odd: being written
        w[base + 1] = h
        w[base + 2] = wid
        at = slot * SLOT_BYTES + 24
        b[at] = len(cid)
        b[at + 1 : at + 1 + len(cid)] = cid
        w[base] += 1
        return True

    def clear(self, key: str) -> None:
        """No hint for ``key`` (from now on)."""
        if key not in self._keys:
            return
        self._keys.discard(key)
        slot = key_hash(key) % SLOTS
        del self._held[slot]
        w = self._words
        base = slot * (SLOT_BYTES // 8)
        w[base] += 1
        w[base + 1] = 0
        w[base + 2] = 0
        w[base] += 1

    @property
    def hinted(self) -> int:
        """How many keys have a hint now (the writer's count)."""
        return len(self._keys)

    # -- a publisher's side -----------------------------------------------------------------------
    def lookup(self, key: str) -> tuple[int, str] | None:
        """``(wid, client id)`` of the receive hinted for ``key``, or None (no hint, or one being written)."""
        h = key_hash(key)
        slot = h % SLOTS
        w = self._words
        base = slot * (SLOT_BYTES // 8)
        seq = w[base]
        if seq & 1 or w[base + 1] != h:
            return None
        wid = w[base + 2]
        at = slot * SLOT_BYTES + 24
        n = self._bytes[at]
        cid = bytes(self._bytes[at + 1 : at + 1 + min(n, CID_MAX)])
        if w[base] != seq or not wid:
            return None
        return wid, cid.decode(errors="replace")


def address(client_id: str) -> bytes:
    """The abstract socket address of a client's offer box."""
    return _ADDRESS_PREFIX + client_id.encode()


class OfferBox:
    """A client's datagram socket: offers to other clients go out through it, offers to this one come in.

    Non-blocking both ways: a send to a box that is gone or full is dropped (the broker's path delivers),
    and :meth:`take` returns what is queued now.
    """

    def __init__(self, client_id: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind(address(client_id))
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._uid = os.getuid()
        self.sent = 0
        self.refused = 0  # datagrams dropped on arrival: another user's, or not an offer
        self._packed_cache: dict[tuple, tuple[bytes, tuple]] = {}
        self._unpacked: dict[bytes, dict[str, Any]] = {}

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, client_id: str, wid: int, key: str, record: dict[str, Any]) -> bool:
        """Offer ``record`` (a publish's item, with its ``owner``) for receive ``wid`` of ``key`` to ``client_id``'s
        box; False when it could not go (gone, full, too large)."""
        data = msgpack.packb((wid, key, record.get("local"), self._packed(record)))
        if len(data) > DATAGRAM_MAX:
            return False
        try:
            self._sock.sendto(data, address(client_id))
        except OSError as exc:  # gone (refused), its queue full, another namespace: the broker delivers
            log.debug("devobj: offer to %s not sent: %s", client_id, exc)
            return False
        self.sent += 1
        return True

    def _packed(self, record: dict[str, Any]) -> bytes:
        """The fields of ``record`` that a publisher's offers of one buffer share (all but the key and export
        token), packed once per buffer: a buffer published again and again has the same field objects (the
        publisher caches its exports, specs and device record), checked by identity, so a hit is never stale."""
        try:
            values = _SHARED_GET(record)
        except KeyError:  # not a publisher's item (a test's): packed every time
            return msgpack.packb({k: v for k, v in record.items() if k not in _PER_OFFER})
        handles = values[1]
        ident = (id(values[0]), id(handles[0]) if len(handles) == 1 else tuple(map(id, handles)), id(values[3]))
        hit = self._packed_cache.get(ident)
        plain = (values[2], *values[4:])  # events, node, process, transport, owner: compared by value
        if hit is not None and hit[1] == plain and _same(hit[2], values):
            return hit[0]
        blob = msgpack.packb({k: v for k, v in record.items() if k not in _PER_OFFER})
        if len(self._packed_cache) >= _CACHE_MAX:
            self._packed_cache.pop(next(iter(self._packed_cache)))
        # The objects held: their ids cannot be reused while the entry lives.
        self._packed_cache[ident] = (blob, plain, values)
        return blob

    def take(self, *, first: bool = False) -> list[dict[str, Any]]:
        """The offers queued now, each ``{"w": wid, "k": key, "r": record}`` (from processes of this user; anything
        else is dropped and counted). ``first``: only up to the first offer (the caller's next wait for the box
        sees any other: no read that finds the box empty, one system call and one exception less)."""
        out = []
        while not (first and out):
            try:
                data, anc, _, _ = self._sock.recvmsg(DATAGRAM_MAX, _CMSG_SPACE)
            except (BlockingIOError, InterruptedError):
                return out
            except OSError as exc:  # closed meanwhile
                log.debug("devobj: offer box: %s", exc)
                return out
            uid = None
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= _UCRED.size:
                    uid = _UCRED.unpack_from(payload)[1]
            offer = self._decode(data) if uid == self._uid else None
            if offer is None:
                self.refused += 1
                continue
            out.append(offer)
        return out

    def _decode(self, data: bytes) -> dict[str, Any] | None:
        """An offer from a datagram, or None where it is not one. A buffer's shared fields are unpacked once."""
        try:
            wid, key, local, blob = msgpack.unpackb(data, use_list=False)
            shared = self._unpacked.get(blob) if type(blob) is bytes else None
            if shared is None:
                shared = msgpack.unpackb(blob)
                if not isinstance(shared, dict) or not isinstance(shared.get("owner"), str):
                    return None
                if len(self._unpacked) >= _CACHE_MAX:
                    self._unpacked.pop(next(iter(self._unpacked)))
                self._unpacked[blob] = shared
        except Exception:  # not msgpack, or not shaped as an offer: not one of ours
            return None
        if type(wid) is not int or type(key) is not str:
            return None
        return {"w": wid, "k": key, "r": dict(shared, local=local)}  # shared: read, never changed

    def close(self) -> None:
        self._sock.close()


def _same(held: tuple, values: tuple) -> bool:
    """Whether a record's specs, exports and device record are the very objects ``held`` (see OfferBox._packed)."""
    return (
        held[0] is values[0]
        and held[3] is values[3]
        and len(held[1]) == len(values[1])
        and all(a is b for a, b in zip(held[1], values[1]))
    )


__all__ = [
    "OFFER_MAX_KEYS",
    "SLOTS",
    "TABLE_BYTES",
    "OfferBox",
    "OfferTable",
    "address",
    "export_id",
    "key_hash",
    "offers_enabled",
]
