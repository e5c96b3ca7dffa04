"""The worker's backend: a :class:`~kvstrata.client.Client` speaking :mod:`kvstrata.server.protocol` to a worker.

The KV and object calls, as requests and replies; current values come straight out of shared memory
through the local-read cache (:mod:`kvstrata.client.local_reads`) where it holds them. How requests
travel (one at a time, pipelined by tag, or through the lane), deferred releases and the worker's
segments are :class:`~kvstrata.client.connection.WorkerConnection`'s.
"""

from __future__ import annotations

import collections
from itertools import repeat
from typing import Any, NamedTuple

from kvstrata._proc import PID
from kvstrata.client._shared import Lease, Loc
from kvstrata.client.connection import WorkerConnection
from kvstrata.errors import CapacityError, InvalidType, ProtocolError
from kvstrata.server import protocol as P
from kvstrata.transport.stream import ATTACH_MIN_BYTES, attach

_ONE = 1  # a flag of 1: a mutable object (kvstrata.server.handlers._acquire)
#: a ``mget`` of at least this many keys leases them and copies their values out of shared memory (:meth:`mget`)
MGET_SHARED_MIN_KEYS = 16
#: how many keys of fewer-key ``mget`` calls a client remembers, to lease them on their second read (:meth:`mget`)
SMALL_READS_REMEMBERED = 4096
_LESS_2 = (-2).__add__  # a flag of 2 + slot: the slot
_SEQ = frozenset({list, tuple})
_INT = frozenset({int})
#: builds a NamedTuple from a tuple in C (its generated __new__ is Python: twice the cost over a 64-key reply)
_new = tuple.__new__


def _lengths(*cols: Any) -> str:
    return "ids, locs, flags of " + ", ".join(str(len(c)) if type(c) is list else type(c).__name__ for c in cols)


def _locs(flat: list[int]) -> Any:
    """The :class:`Loc` of each ``[segment, offset, size]`` of a flat reply list."""
    return map(_new, repeat(Loc), zip(flat[0::3], flat[1::3], flat[2::3]))


class _Unsent(NamedTuple):
    """A lease request made ready by ``acquire_start(send=False)`` and not sent yet."""

    msg: dict
    carry: bool
    timeout: float


class RemoteBackend(WorkerConnection):
    """A connection to a worker. Requests are serialized on the connection (one at a time)."""

    #: a value this large or larger in a ``mset`` of many keys goes through shared memory (``Client.mset``)
    shared_batch_bytes = 1024

    # calls ---------------------------------------------------------------------------------------
    def put(self, key: str, data: memoryview, opts: dict) -> None:
        msg = {"op": "put", "key": key, "v": attach(data)}  # (a large value beside the message: no copy to encode)
        if opts["ttl"] is not None or opts["nx"] or opts["mode"] != "memory":  # the worker's defaults go unsaid
            msg.update(opts)
        self.request(msg)

    def mput(self, items: list[tuple[str, memoryview]], opts: dict) -> list[Any]:
        if any(len(v) >= ATTACH_MIN_BYTES for _, v in items):
            items = [(k, attach(v)) for k, v in items]
        reply = self.request({"op": "mput", "items": items, **opts})
        return [self._item(i) for i in reply["items"]]

    def create(self, key: str, size: int, opts: dict) -> Loc:
        return self._loc(self.request({"op": "create", "key": key, "size": size, **opts})["loc"])

    def mcreate(self, items: list[tuple[str, int]], opts: dict) -> list[Any]:
        return self.mcreate_finish(self.mcreate_start(items, opts))

    def mcreate_start(self, items: list[tuple[str, int]], opts: dict) -> Any:
        """:meth:`mcreate`, sent and not waited for (pipelined); :meth:`mcreate_finish` takes its result."""
        msg = {"op": "mcreate", "items": items}
        if opts["ttl"] is not None or opts["nx"] or opts["mode"] != "memory":  # the worker's defaults go unsaid
            msg.update(opts)
        return self.send_tagged(msg)

    def mcreate_finish(self, token: Any) -> list[Any]:
        reply = self.tagged_reply(token)
        flat = reply["locs"]
        out: list[Any] = list(_locs(flat))
        for i, name, message in reply.get("errs", ()):
            out[i] = P.error_from_record((name, message))
        return out

    def finish(self, action: str, key: str) -> None:
        self.request({"op": action, "key": key})

    def mseal(self, keys: list[str]) -> list[Any]:
        return self.mseal_finish(self.mseal_start(keys))

    def mseal_start(self, keys: list[str]) -> Any:
        """:meth:`mseal`, sent and not waited for (pipelined); :meth:`mseal_finish` takes its result."""
        return self.send_tagged({"op": "mseal", "keys": keys}), len(keys)

    def mseal_finish(self, token: Any) -> list[Any]:
        tag, n = token
        out: list[Any] = [None] * n
        for i, name, message in self.tagged_reply(tag).get("errs", ()):
            out[i] = P.error_from_record((name, message))
        return out

    def reserve_start(self, nbytes: int) -> Any:
        """Ask for a write reservation of ``nbytes`` (``kvstrata.store.reservations``), not waited for;
        :meth:`reserve_finish` takes the granted extent."""
        return self.send_tagged({"op": "reserve", "size": nbytes}, carry=False)

    def reserve_finish(self, token: Any) -> Loc:
        return self._loc(self.tagged_reply(token)["loc"])

    def commit_start(
        self, items: list[tuple[str, int, int]], opts: dict, linger_us: int = 0, *, landing: bool = False
    ) -> Any:
        """Commit ``(key, size, offset)`` s carved from this client's reservation, not waited for;
        :meth:`commit_finish` gives ``(per-item results, the reservation's head after it or None)``.
        ``linger_us``: another commit follows within that many microseconds (see :meth:`linger`).
        ``landing`` (where :attr:`can_land`): sent before the copies into the objects finished; answered at
        once, its objects visible only once :meth:`land` says the copies did (freed if it says they failed),
        which the caller must then say."""
        msg: dict = {"op": "commit", "items": items}
        if self.columns and items:  # as columns (protocol: "columns")
            try:
                if set(map(len, items)) == {3}:
                    keys, sizes, offsets = zip(*items)
                    msg = {"op": "commit", "keys": keys, "sizes": P.int_column(sizes), "offsets": P.int_column(offsets)}
            except (TypeError, OverflowError):  # not (key, int, int) triples: as they are, for the worker to name
                pass
        if opts["ttl"] is not None or opts["nx"] or opts["mode"] != "memory":  # the worker's defaults go unsaid
            msg.update(opts)
        if linger_us > 0:
            msg["linger"] = linger_us
        if landing:
            msg["landing"] = True
        tag = self.send_tagged(msg)
        if landing and tag > self._landing_last:
            self._landing_last = tag
        return tag, len(items)

    @property
    def can_land(self) -> bool:
        """Whether a commit may go before its copies landed (its objects then wait for :meth:`land`): there is a
        lane, and the worker has read the landing words of every such commit sent before (see
        :meth:`kvstrata.server.lane.Lane.settled`; it nearly always has, long before the next call)."""
        lane = self._lane
        return lane is not None and lane.settled() >= self._landing_last

    def land(self, token: Any, ok: bool = True) -> None:
        """Say that the copies of the ``landing`` commit ``token`` (and of every earlier one) landed, or that
        those not landed yet failed: from this store on, every operation of anyone sees its objects (or never
        will)."""
        lane = self._lane
        if lane is not None and self._pid == PID[0]:  # (a forked child's copy of the lane is the parent's)
            lane.land(token[0], ok)

    def land_failed(self) -> None:
        """Say that the copies of every ``landing`` commit this connection sent and did not :meth:`land` yet
        failed (their objects are freed, never shown): the highest tag sent covers them all, as tags grow, even
        one whose :meth:`commit_start` was interrupted after its request went out."""
        lane = self._lane
        if lane is not None and self._pid == PID[0]:  # (in a forked child: the parent's commits, not to be failed)
            lane.land(self._tag, ok=False)

    def linger(self, us: int) -> None:
        """Tell the worker (one-way) that this client's next request follows within ``us`` microseconds, so
        its thread keeps polling (where the worker polls at all) rather than sleep and be woken for it."""
        if self._pid != PID[0]:
            return  # a copy inherited through fork(): the socket is the parent's
        with self._lock:
            if not self._closed and not self._conn.closed:
                self._conn.send({"op": "linger", "linger": us})

    def commit_finish(self, token: Any) -> tuple[list[Any], int | None]:
        tag, n = token
        reply = self.tagged_reply(tag)
        out: list[Any] = [None] * n
        for i, name, message in reply.get("errs", ()):
            out[i] = P.error_from_record((name, message))
        return out, reply.get("head")

    def get(self, key: str, timeout: float) -> bytes:
        local = self._local
        if local is None:
            return self._value(self.request({"op": "get", "key": key, "timeout": timeout}))
        generation = local.generation()  # read before the request: see kvstrata.server.validity
        cache = True
        with self._lock:
            if not self._closed and self._pid == PID[0]:
                loc = local.lookup(key)
                # Still current, and the worker still there (a dead one makes its socket readable at EOF):
                # straight out of shared memory, no round trip.
                if loc is not None and self._worker_there():
                    local.count(key)
                    return bytes(self._segments[loc.segment].buffer[loc.offset : loc.offset + loc.size])
                cache = local.admits(key)
        if not cache:
            return self._value(self.request({"op": "get", "key": key, "timeout": timeout}))
        reply = self.request({"op": "get", "key": key, "timeout": timeout, "cache": True})
        if not reply.get("cache"):
            return self._value(reply)
        loc = self._loc(reply["loc"])
        data = bytes(self.view(loc))
        with self._lock:
            lease_id = reply["lease"]
            if self._closed:
                return data  # the worker released what this client held when it closed
            # The entries the cache let go of ride along with the next request rather than a message of their own:
            # a get of keys the cache cannot hold all (each one pushing the oldest out) then costs one message, not
            # two (1,024 keys of 4 KiB read round-robin through a worker: ~64 us a get on the development machine
            # with a release message after each, as Redis's 35; see test_a_get_past_the_cache_sends_one_message)
            self._deferred.extend(self._cache_add(key, lease_id, loc, generation, reply.get("slot", 0)))
        return data

    def _cache_add(self, key: str, lease_id: int, loc: Loc, generation: int, slot: int) -> list[int]:
        """Offer a lease to the local-read cache (under the lock); returns leases the cache let go of."""
        drop = self._local.add(key, lease_id, loc, generation, slot)
        if lease_id not in drop:
            self._hold(lease_id)  # the cache's hold
        return drop

    def mget(self, keys: list[str], timeout: float) -> list[Any]:
        """Each key's value (or its error). A call of :data:`MGET_SHARED_MIN_KEYS` keys or more leases them
        (:meth:`acquire`: the local-read cache's current leases need no round trip, and new cacheable ones are
        kept where they fit) and copies each value once, straight out of shared memory, instead of having the
        worker copy the values into its reply: through a worker on the development machine, 1,000 values a call,
        4 KiB took ~8 us a key that way against ~44, 16 KiB 11 against 112, 64 B 6 against 9 (session 31)."""
        if not self.shm or (len(keys) < MGET_SHARED_MIN_KEYS and not self._read_again(keys)):
            return self._mget_copied(keys, timeout)
        leases = self.acquire(keys, timeout, cache="fit")
        out: list[Any] = []
        held = [x.lease_id for x in leases if not isinstance(x, BaseException)]
        try:
            for x in leases:
                out.append(x if isinstance(x, BaseException) else bytes(self.view(x.location)))
        finally:
            self.release(held)
        # A key on SSD alone with the memory tier all leased has no lease to give: the worker's mget reads it from SSD.
        again = [i for i, r in enumerate(out) if isinstance(r, CapacityError)]
        if again:
            for i, r in zip(again, self._mget_copied([keys[i] for i in again], 0.0)):
                out[i] = r
        return out

    _small_reads: collections.OrderedDict | None = None

    def _read_again(self, keys: list[str]) -> bool:
        """Whether most of a fewer-key mget's keys were read by one before (the last :data:`SMALL_READS_REMEMBERED`):
        those go the leasing way, whose kept leases then answer each later read from shared memory with no round
        trip; keys read once go the copying way, one round trip. (Through a worker on the development machine, 4 KiB
        values read again and again: 1 key 43 -> 9 us a call, 5 keys 64 -> 24, 11 keys 100 -> 38; keys read once
        each: 47 / 77 / 111 us copied, 72 / 128 / 127 leased. A ClusterClient splits a batch into a few keys per
        worker: ``kvstrata bench cluster`` measures it.)"""
        with self._lock:
            seen = self._small_reads
            if seen is None:
                seen = self._small_reads = collections.OrderedDict()
            again = 0
            for key in keys:
                if key in seen:
                    again += 1
                    seen.move_to_end(key)
                else:
                    seen[key] = None
            while len(seen) > SMALL_READS_REMEMBERED:
                seen.popitem(last=False)
        return 2 * again >= len(keys)

    def _mget_copied(self, keys: list[str], timeout: float) -> list[Any]:
        """:meth:`mget` as the worker answers it: values copied into the reply (a large one leased and copied here)."""
        items = self.request({"op": "mget", "keys": keys, "timeout": timeout})["items"]
        return [r if isinstance(r, BaseException) else self._value(r) for r in map(self._item, items)]

    def mget_views(self, keys: list[str], timeout: float) -> list[Any]:
        """:meth:`mget` through a worker with no shared memory (TCP), each value as the reply brought it: a writable
        view of the reply's frame (an attachment) or a bytearray (a small value), never copied again; the
        exception in a missing key's slot (:mod:`kvstrata.client.device_bytes` reads tensors out of these)."""
        if self.shm:
            raise ProtocolError("mget_views: for a worker over TCP (with shared memory, lease the values instead)")
        items = self.request({"op": "mget", "keys": keys, "timeout": timeout})["items"]
        out: list[Any] = []
        for r in map(self._item, items):
            if not isinstance(r, BaseException):
                v = r["v"]
                r = v if type(v) is memoryview and not v.readonly else bytearray(v)
            out.append(r)
        return out

    def _value(self, item: dict) -> bytes:
        if "v" in item:
            v = item["v"]
            return v if type(v) is bytes else bytes(v)  # (an attachment: a view of the reply's frame)
        try:
            return bytes(self.view(self._loc(item["loc"])))  # the one copy, straight out of shared memory
        finally:
            self.release([item["lease"]])

    def acquire(self, keys: list[str], timeout: float, *, cache: bool | str = False) -> list[Any]:
        """Leases for zero-copy views. A key the local-read cache holds current needs no round trip:
        the view shares the cache's lease (see ``_holders``), so its bytes stay pinned until released.
        ``cache``: also keep the leases of cacheable objects fetched now, for later calls (``"fit"``:
        only where they fit beside the entries already kept, pushing none out)."""
        out = self.acquire_finish(self.acquire_start(keys, timeout, cache=cache))
        self.settle()
        return out

    def acquire_start(
        self,
        keys: list[str],
        timeout: float,
        *,
        cache: bool | str = False,
        carry: bool = True,
        placements: bool = False,
        send: bool = True,
        local: bool = True,
    ) -> Any:
        """:meth:`acquire`: the local-read cache's leases now, the worker's requested and not waited for
        (pipelined, ``carry`` as in :meth:`send_tagged`); :meth:`acquire_finish` completes it,
        :meth:`acquire_ready` says whether that needs the worker's answer still. ``placements``: the worker also
        says each lease's placement (:meth:`acquire_placements`, after the finish). ``send=False``: the request
        is only made ready; :meth:`acquire_send` sends it (the finish does, where nothing did), so a caller
        can learn what the cache serves and do other work before the request goes. ``local=False``: every key
        is asked for, none looked up in the cache (for keys likely changed: their stale entries are then
        replaced when the new leases are entered, off the caller's path, instead of dropped here)."""
        cached = local
        local = self._local
        n = len(keys)
        out: list[Any] = [None] * n
        generation = 0
        if local is not None:
            generation = local.generation()  # read before the request: see kvstrata.server.validity
            with self._lock:
                if cached and len(local) and not self._closed and self._pid == PID[0]:
                    got = local.entries(keys)
                    # Served only while the worker is there (a dead one makes its socket readable at EOF); where no
                    # entry is current (a cold read) the request finds out, with no system call here.
                    if got.count(None) != n and self._worker_there():
                        holders = self._holders
                        get = holders.get
                        for i, entry in enumerate(got):
                            if entry is not None:
                                lease_id = entry[0]
                                holders[lease_id] = get(lease_id, 0) + 1  # the view's hold
                                out[i] = _new(Lease, (lease_id, entry[1], False))  # in C: a device call's every key
        nothing = out.count(None)
        if not nothing:
            return keys, out, None, None, generation, cache, None, None
        if nothing == n:  # none kept (a first read, or the keys were rewritten): ask for all, as given
            missing: list[int] | None = None
            msg = {"op": "acquire", "keys": keys, "timeout": timeout}
        else:
            missing = [i for i, lease in enumerate(out) if lease is None]
            msg = {"op": "acquire", "keys": [keys[i] for i in missing], "timeout": timeout}
        if cache and local is not None:
            msg["cache"] = True
        if self.columns:
            msg["cols"] = 1  # the reply's integer columns as bytes (protocol: "columns")
        placed = None
        if placements:
            msg["placements"] = True
            placed = [0] * n
        sent = (self.send_tagged(msg, carry=carry), timeout) if send else _Unsent(msg, carry, timeout)
        # (the reply's columns, for acquire_columns: filled by acquire_finish where every key was asked with placements)
        columns = [] if placed is not None and missing is None else None
        return keys, out, missing, sent, generation, cache, placed, columns

    def kept_leases(self, keys: list[str]) -> tuple[list[int], list[Loc]] | None:
        """The leases the local-read cache keeps current for the longest run of ``keys`` from the first, pinned for
        the caller, as ``(the pin's token in a list, their locations)``; give the list back with :meth:`release`
        (with more lease ids after it, if need be). None, pinning nothing, where the first key's is not kept and
        current (the caller then takes :meth:`acquire_start`'s way for all). No round trip, no lease objects and no
        hold per key: one pin keeps every lease this client holds until it is given back (``_pin``), for a device
        call that plans and queues those keys in one pass too, and the rest of the keys another way."""
        local = self._local
        if local is None:
            return None
        with self._lock:
            if self._closed or self._pid != PID[0]:
                return None
            locs = local.locations_prefix(keys)
            if not locs or not self._worker_there():
                return None
            return [self._pin()], locs

    def acquire_send(self, token: Any) -> Any:
        """Send the request of an :meth:`acquire_start` made with ``send=False`` (if it needs one, and not sent
        yet); the token to use from then on."""
        sent = token[3]
        if type(sent) is not _Unsent:
            return token
        return (*token[:3], (self.send_tagged(sent.msg, carry=sent.carry), sent.timeout), *token[4:])

    @staticmethod
    def acquire_ready(token: Any) -> bool:
        """Whether an :meth:`acquire_start` was served by the local-read cache alone (nothing to wait for)."""
        return token[3] is None

    @staticmethod
    def acquire_local(token: Any) -> list[Any]:
        """The leases the local-read cache served an :meth:`acquire_start` at once, per key (None for the keys
        the worker is asked for). Read only."""
        return token[1]

    @staticmethod
    def acquire_placements(token: Any) -> list[int] | None:
        """After :meth:`acquire_finish` of one started with ``placements=True`` and sent to the worker: each
        asked key's lease's placement (0 for the keys the cache served and the refused ones); else None."""
        return token[6]

    @staticmethod
    def acquire_columns(token: Any) -> tuple[list[int], list[tuple[int, int, int, int]]] | None:
        """After :meth:`acquire_finish` of one started with ``placements=True`` and ``local=False`` (every key asked
        of the worker): each key's lease id (0 where refused) and ``(segment, offset, size, placement)`` of its
        lease (zeros where refused, placement 0 from an older worker), built in C from the reply, as a placement
        hint is (:meth:`placement_hints`): a caller compares them all at once. Else None."""
        columns = token[7]
        return (columns[0], columns[1]) if columns else None

    def placement_hints(self, keys: list[str]) -> list[tuple[int, int, int, int] | None] | None:
        """Where the worker's table says each key's bytes lie now, ``(segment, offset, size, placement)`` or
        None per key; None where there is no table. Advice only (:mod:`kvstrata.store.placements`)."""
        hints = self.placements
        return None if hints is None else hints.lookup(keys)

    def acquire_finish(self, token: Any, *, leases: bool = True) -> list[Any]:
        """The leases of an :meth:`acquire_start` (a key's error in its slot). The worker's reply is checked for
        shape (ProtocolError, and the connection ends, where it is not what was asked for); leases the local-read
        cache may keep are judged at once and entered at the next :meth:`settle`. ``leases=False``, for a token
        whose reply :meth:`acquire_columns` keeps: no lease objects, only the errors in their slots (None for the
        keys granted: the caller reads their leases in the columns)."""
        if type(token[3]) is _Unsent:
            token = self.acquire_send(token)
        keys, out, missing, sent, generation, cache, placed, columns = token
        if sent is None:
            return out
        reply = self.tagged_reply(*sent)
        asked = keys if missing is None else [keys[i] for i in missing]
        ids, flat, flags, errs = self._acquire_columns(reply, len(asked))
        if placed is not None:
            got = reply.get("placed")
            if type(got) is list and len(got) == len(asked) and _INT.issuperset(map(type, got)):
                if missing is None:
                    placed[:] = got
                else:
                    for i, p in zip(missing, got):
                        placed[i] = p
            # else: an older worker; every early copy is redone from its lease
            if columns is not None:
                columns += ids, list(zip(flat[0::3], flat[1::3], flat[2::3], placed))
        locs = list(_locs(flat))
        if leases or columns is None:
            made = map(_new, repeat(Lease), zip(ids, locs, map(_ONE.__eq__, flags)))
            if missing is None:
                out[:] = made
            else:
                for i, lease in zip(missing, made):
                    out[i] = lease
        if errs:
            for j, name, message in errs:
                out[j if missing is None else missing[j]] = P.error_from_record((name, message))
        local = self._local
        # 2 + the key's slot: a lease the local-read cache may keep (every one, where the keys are plain objects)
        if local is not None and flags and max(flags) >= 2:
            if min(flags) < 2:
                pick = [j for j, flag in enumerate(flags) if flag >= 2]
                asked, ids, locs, flags = ([col[j] for j in pick] for col in (asked, ids, locs, flags))
            with self._lock:
                if self._closed:
                    return out
                # The cache's entries are made at the next settle(), off the path to the caller's copies; the leases
                # are judged now and counted as the cache's and the view's from now on. One the cache does not
                # keep in the end goes back through _unhold, as a dropped entry's does: the view's hold remains.
                refused = local.add_columns(
                    asked, ids, locs, map(_LESS_2, flags), generation, evict=cache != "fit", later=True
                )
                holders = self._holders
                if holders.keys().isdisjoint(ids):  # new leases, as the worker's ids always are
                    holders.update(dict.fromkeys(ids, 2))
                else:
                    for lease_id in ids:
                        holders[lease_id] = holders.get(lease_id, 0) + 2
            if refused:
                self.release(refused)
        return out

    def settle(self) -> None:
        """Make the local-read entries that acquires left for later (see :meth:`acquire_finish`) and give back at
        once the leases that lets go of (the entries' older versions after a rewrite): a device call does it
        while its copies run, so neither is left for its end."""
        self.release([])

    def _acquire_columns(self, reply: dict, n: int) -> tuple[list[int], list[int], list[int], list]:
        """The ``ids``, flat ``locs``, ``flags`` and ``errs`` of an ``acquire`` reply for ``n`` keys, checked for
        shape. A malformed one ends the connection (its leases go back with it: the worker releases a lost
        client's)."""
        ids, flat, flags, errs = reply.get("ids"), reply.get("locs"), reply.get("flags"), reply.get("errs", ())
        if type(ids) is bytes:  # columns as bytes (protocol: "columns"): the lengths are checked as they decode
            try:
                ids, flat, flags = (
                    P.column_ints(ids, n, "ids"),
                    P.column_ints(flat, 3 * n, "locs"),
                    P.column_ints(flags, n, "flags"),
                )
                placed = reply.get("placed")
                if type(placed) is bytes and len(placed) == 8 * n:  # (anything else: as from an older worker)
                    reply["placed"] = P.column_ints(placed, n, "placed")
            except InvalidType:
                ids = None  # malformed: said so below
        ok = (
            type(ids) is list
            and type(flat) is list
            and type(flags) is list
            and len(ids) == n == len(flags)
            and _INT.issuperset(map(type, flags))  # compared and added to below
            and len(flat) == 3 * n
            and type(errs) in _SEQ
        )
        if ok and errs:
            ok = all(
                type(e) in _SEQ and len(e) == 3 and type(e[0]) is int and 0 <= e[0] < n and flags[e[0]] == 0
                for e in errs
            )
        if ok:
            return ids, flat, flags, errs
        with self._lock:
            self._broken = "a malformed acquire reply"
            self._conn.close()
        raise ProtocolError(
            f"worker answered an acquire of {n} keys with {_lengths(ids, flat, flags)} and errs {errs!r:.100}:"
            " connection closed"
        )

    def read(self, key: str, offset: int, size: int) -> bytes:
        v = self.request({"op": "read", "key": key, "offset": offset, "size": size})["v"]
        return v if type(v) is bytes else bytes(v)  # (an attachment: a view of the reply's frame)

    def keys_op(self, op: str, keys: list[str], **kw: Any) -> list[Any]:
        return self.request({"op": op, "keys": keys, **kw})["r"]

    def refcount(self, key: str) -> int:
        return self.request({"op": "refcount", "key": key})["r"]

    def stats(self) -> dict:
        return self.request({"op": "stats"})["stats"]

    def flush(self) -> None:
        self.request({"op": "flush"})
