"""Request handlers of the worker: one function per protocol op, ``(session, message) -> reply``.

Each validates its fields (ValueError/TypeError naming them), calls the engine with the session as
``owner``, and returns the reply fields; the session turns exceptions into error records. Batch
handlers answer per key. See :mod:`kvstrata.server.protocol` for the message shapes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any

from kvstrata.devobj import service as devobj_service
from kvstrata.errors import CapacityError, InvalidType, KvstrataError, ServerError
from kvstrata.server import protocol as P
from kvstrata.server.validity import SLOTS
from kvstrata.store.tiers.base import Location
from kvstrata.transport.stream import attach

if TYPE_CHECKING:
    from kvstrata.server.session import Session

_PAIR_TYPES = frozenset({list, tuple})
#: pairs of a ``mput`` written per call of the store's ``put_many`` (its own chunks hold the lock for at most as many)
MPUT_CHUNK = 256
_LOCATION_TYPES = frozenset({Location})


def _value(msg: dict) -> bytes | memoryview:
    """A message's value: bytes, or a memoryview of its frame where it came as an attachment."""
    v = msg.get("v")
    if type(v) is not memoryview and not isinstance(v, bytes):
        raise InvalidType(f"value: expected bytes on the wire, got {type(v).__name__}")
    return v


def _refuser(s: Session, msg: dict) -> Any:
    """For a write a cluster client routed (its ``"view"``: the fingerprint of its member list), the worker's per-key
    refusal of keys not its own under a list that differs (Worker.not_owned); None where nothing is checked."""
    view = msg.get("view")
    return None if view is None else s.worker.not_owned(view)


def _routed(s: Session, msg: dict, key: str) -> None:
    """NotOwner where ``key`` of a one-key write is refused (see :func:`_refuser`)."""
    refuse = _refuser(s, msg)
    refusal = None if refuse is None else refuse(key)
    if refusal is not None:
        raise refusal


def _put(s: Session, msg: dict) -> dict:
    # the single small put is the hot path: inline (every call here is ~0.3 us of ~10)
    opts = s.write_options(msg)
    key, value = P.check_key(msg.get("key")), msg.get("v")
    if "view" in msg:
        _routed(s, msg, key)
    if type(value) is not bytes:
        value = _value(msg)
    validity = s.validity
    with validity.change(key), validity.key_lock(key):
        s.store.put(key, value, owner=s.owner, **opts)
        validity.written(key, opts["ttl"])
    return {}


def _mput(s: Session, msg: dict) -> dict:
    """Reply ``{"items": [{} or an error record, ...]}``, one per ``[key, value]`` pair. The well-formed pairs go
    to the store's ``put_many`` :data:`MPUT_CHUNK` at a time (one hold of the store's lock and of the chunk's
    validity stripes each), not one ``put`` per key."""
    opts = s.write_options(msg)
    pairs = msg.get("items", [])
    if type(pairs) is not list and type(pairs) is not tuple:
        raise InvalidType(f"items: expected a list of [key, value] pairs, got {type(pairs).__name__}")
    items: list[dict] = [{}] * len(pairs)  # {} (shared: never changed) where the pair was written
    good: list[tuple[str, bytes]] = []
    at: list[int] = []  # the pairs' positions of ``good``
    for i, pair in enumerate(pairs):
        try:
            if type(pair) not in _PAIR_TYPES or len(pair) != 2:
                got = f"a list of {len(pair)}" if type(pair) in _PAIR_TYPES else type(pair).__name__
                raise InvalidType(f"items[{i}]: expected a [key, value] pair, got {got}")
            key, value = pair
            good.append((P.check_key(key), value if type(value) is bytes else _value({"v": value})))
            at.append(i)
        except (KvstrataError, ValueError, TypeError) as exc:
            items[i] = P.error_record(exc)
    refuse = _refuser(s, msg)
    if refuse is not None:  # keys of a write routed by another member list that are not this worker's: refused
        refusals = [refuse(key) for key, _ in good]
        for i, refusal in zip(at, refusals):
            if refusal is not None:
                items[i] = P.error_record(refusal)
        good = [pair for pair, refusal in zip(good, refusals) if refusal is None]
        at = [i for i, refusal in zip(at, refusals) if refusal is None]
    ttl = opts["ttl"]
    for lo in range(0, len(good), MPUT_CHUNK):
        chunk = good[lo : lo + MPUT_CHUNK]
        keys = [key for key, _ in chunk]
        with _sealing(s.validity, keys):
            try:
                results: list = s.store.put_many(chunk, owner=s.owner, **opts)
            except (KvstrataError, ValueError, TypeError) as exc:  # an option no key can be written with
                results = [exc] * len(chunk)
            written = keys if results.count(None) == len(keys) else [k for k, r in zip(keys, results) if r is None]
            s.validity.written_many(written, [ttl] * len(written))
        for i, r in zip(at[lo : lo + MPUT_CHUNK], results):
            if r is not None:
                items[i] = P.error_record(r)
    return {"items": items}


def _create(s: Session, msg: dict) -> dict:
    key = P.check_key(msg.get("key"))
    size = P.check_size(msg.get("size"))
    opts = s.write_options(msg)
    _routed(s, msg, key)
    location = s.store.create(key, size, owner=s.owner, **opts)
    s.writes[key] = opts["ttl"]
    reply: dict = {}
    reply["loc"] = s.loc(location, reply)
    return reply


def _mcreate(s: Session, msg: dict) -> dict:
    """Reply ``{"locs": [segment, offset, size] * n flat, "errs": [[i, type, message], ...]}`` (a refused
    key's location is zeros): parallel arrays, not a dict per key, so a 64-key batch encodes and decodes in
    a few microseconds."""
    opts = s.write_options(msg)
    pairs = msg.get("items", [])
    if type(pairs) is not list or not _PAIR_TYPES.issuperset(map(type, pairs)) or any(len(p) != 2 for p in pairs):
        raise InvalidType("items: expected a list of [key, size] pairs")
    refuse = _refuser(s, msg)
    refusals = None if refuse is None else [refuse(p[0]) if type(p[0]) is str else None for p in pairs]
    if refusals is None or refusals.count(None) == len(pairs):
        results = s.store.create_many(pairs, owner=s.owner, **opts)
    else:  # keys of a write routed by another member list that are not this worker's: refused, the rest created
        created = iter(s.store.create_many([p for p, r in zip(pairs, refusals) if r is None], owner=s.owner, **opts))
        results = [next(created) if r is None else r for r in refusals]
    reply: dict = {}
    errs = []
    ttl = opts["ttl"]
    if set(map(type, results)) <= _LOCATION_TYPES:  # every key created: no per-key step
        s.writes.update(dict.fromkeys([p[0] for p in pairs], ttl))
        locs = list(chain.from_iterable(results))
    else:
        locs = []
        writes = s.writes
        for i, ((key, _), r) in enumerate(zip(pairs, results)):
            if isinstance(r, BaseException):
                errs.append([i, *P.error_record(r)["err"]])
                locs += (0, 0, 0)
            else:
                writes[key] = ttl
                locs += r
    s.new_segments(locs, reply)
    reply["locs"] = locs
    if errs:
        reply["errs"] = errs
    return reply


def _result(fn: Any) -> Any:
    try:
        return fn()
    except (KvstrataError, ValueError, TypeError) as exc:
        return exc


def _finish_one(s: Session, action: str, key: str) -> None:
    if action == "abort":  # nothing visible changes
        s.store.abort(key, owner=s.owner)
        s.writes.pop(key, None)
        return
    with s.validity.key_lock(key):
        try:
            getattr(s.store, action)(key, owner=s.owner)
        except BaseException:
            s.writes.pop(key, None)  # a refused seal ends the create too (the store dropped it)
            raise
        s.validity.written(key, s.writes.pop(key, 0.0))  # an unknown TTL counts as one


def _finish(action: str):
    def handle(s: Session, msg: dict) -> dict:
        key = P.check_key(msg.get("key"))
        if action == "abort":
            _finish_one(s, action, key)
            return {}
        with s.validity.change(key):
            _finish_one(s, action, key)
        return {}

    return handle


@contextlib.contextmanager
def _sealing(validity: Any, keys: list[str]) -> Iterator[None]:
    """Around a batch that makes ``keys`` visible (seal, commit): the validity change, with each key's lock
    held, so the no-TTL set changes with the versions (as in _finish_one)."""
    locks = validity.key_locks(keys)
    with validity.change(keys):
        for lock in locks:
            lock.acquire()
        try:
            yield
        finally:
            for lock in locks:
                lock.release()


def _mseal(s: Session, msg: dict) -> dict:
    """Reply ``{"errs": [[i, type, message], ...]}`` (absent when every key was sealed)."""
    keys = P.check_keys(msg.get("keys", []))
    with _sealing(s.validity, keys):
        results = s.store.seal_many(keys, owner=s.owner)
        sealed = keys if results.count(None) == len(keys) else [k for k, r in zip(keys, results) if r is None]
        # an unknown TTL counts as one
        s.validity.written_many(sealed, list(map(s.writes.pop, sealed, repeat(0.0))))
    if results.count(None) == len(results):
        return {}
    return {"errs": [[i, *P.error_record(r)["err"]] for i, r in enumerate(results) if r is not None]}


def _reserve(s: Session, msg: dict) -> dict:
    """Reply ``{"loc": [segment, offset, size]}``: the write reservation granted (``store.reservations``),
    whose size may be less than asked; a new one replaces the client's old one."""
    location = s.store.reserve(s.owner, P.check_size(msg.get("size")))
    reply: dict = {}
    reply["loc"] = s.loc(location, reply)
    return reply


def _commit(s: Session, msg: dict) -> dict:
    """Objects carved from the client's reservation, sealed: ``items`` are ``[key, size, offset]`` in carving
    order. Reply ``{"head": offset or None, "errs": [[i, type, message], ...]}``: where the reservation's
    head is now (None: the client holds none), and the refused items (absent when every one was sealed).
    ``"landing": true``: sent before the copies into the objects finished; answered at once, the objects made
    visible when the client says in the lane page that the copies landed (``store.reservations``; every
    request of anyone after that sees them), freed if it says they failed; a TTL runs from then."""
    opts = s.write_options(msg)
    refuse = _refuser(s, msg)  # (keys not this worker's refused one by one, their pieces freed)
    if refuse is not None:
        opts = {**opts, "refuse": refuse}
    keys = msg.get("keys")
    if keys is not None:  # the items as columns (protocol: "columns"), each item a tuple made in C
        if type(keys) is not list or len(keys) > P.MAX_BATCH:
            raise InvalidType(f"keys: expected a list of at most {P.MAX_BATCH} keys")
        n = len(keys)
        sizes, offsets = P.column_ints(msg.get("sizes"), n, "sizes"), P.column_ints(msg.get("offsets"), n, "offsets")
        items = list(zip(keys, sizes, offsets))
    else:
        items = msg.get("items", [])
    if type(items) is not list or len(items) > P.MAX_BATCH:
        raise InvalidType(f"items: expected a list of at most {P.MAX_BATCH} [key, size, offset] triples")
    if msg.get("landing"):
        # Nothing becomes visible now: the store shows the objects as they land, inside the validity's change of
        # the keys they replace, and tells it which (ObjectStore.set_visibility). The store only checks the items
        # and takes their keys before this answer; their pieces are cut right after it (Session._watch_landings).
        results = s.store.commit(s.owner, items, **opts, landed=s.landing_check(msg.get("tag")))
        if None in results:
            s.landing_tags.append(msg["tag"])  # the session watches for the word (Session._next)
    else:
        keys = [it[0] for it in items if type(it) in _PAIR_TYPES and len(it) == 3 and type(it[0]) is str and it[0]]
        with _sealing(s.validity, keys):
            results = s.store.commit(s.owner, items, **opts)
            ok = [it[0] for it, r in zip(items, results) if r is None]  # a sealed item is a well-formed one
            s.validity.written_many(ok, [opts["ttl"]] * len(ok))
    rest = s.store.reservation(s.owner)
    reply: dict = {"head": None if rest is None else rest.offset}
    if results.count(None) != len(results):
        reply["errs"] = [[i, *P.error_record(r)["err"]] for i, r in enumerate(results) if r is not None]
    return reply


def _copied(s: Session, key: str) -> dict:
    """A read whose object is on SSD only and cannot come back into DRAM (every byte there leased): its bytes in
    the reply, read straight from SSD, as a copying read in process gets them (``ObjectStore.get_bytes``)."""
    try:
        return {"v": attach(s.store.get_bytes(key, timeout=0))}
    except (KvstrataError, ValueError) as exc:
        return P.error_record(exc)


def _get(s: Session, msg: dict) -> dict:
    key = P.check_key(msg.get("key"))
    try:
        lease = s.store.acquire(key, owner=s.owner, timeout=P.check_timeout(msg.get("timeout", 0)))
    except CapacityError:  # on SSD only, and DRAM all leased: the bytes straight from SSD (see _copied)
        return {"v": attach(s.store.get_bytes(key, timeout=0))}
    reply: dict = {}
    if msg.get("cache") and s.shm and lease.size < P.INLINE_MAX and s.validity.cacheable(key, lease):
        # The client keeps this lease and serves later gets from shared memory (see server.validity).
        s.leases.add(lease.lease_id)
        loc = s.loc(lease.location, reply)
        return {"lease": lease.lease_id, "loc": loc, "cache": True, "slot": s.validity.slot_of(key), **reply}
    reply.update(s.lease_item(lease, reply))
    return reply


def _mget(s: Session, msg: dict) -> dict:
    keys = P.check_keys(msg.get("keys", []))
    reply: dict = {}
    items = []
    results = s.store.acquire_many(keys, owner=s.owner, timeout=P.check_timeout(msg.get("timeout", 0)))
    for key, result in zip(keys, results):
        if isinstance(result, CapacityError):
            items.append(_copied(s, key))
        else:
            items.append(P.error_record(result) if isinstance(result, BaseException) else s.lease_item(result, reply))
    reply["items"] = items
    return reply


def _acquire(s: Session, msg: dict) -> dict:
    """Leases for zero-copy views, never inlined (``get_buffers``, ``mget_h2d``).

    Reply ``{"ids": [lease id] * n, "locs": [segment, offset, size] * n flat, "flags": [...] * n,
    "errs": [[i, type, message], ...]}``: a flag is ``1`` for a mutable object, ``2 + slot`` for a lease
    the client may keep for local reads (``slot``: the key's counter in :mod:`kvstrata.server.validity`),
    else ``0``; a refused key has id 0 and zeros. With ``"placements": true`` also ``"placed": [...] * n``,
    each lease's placement (:mod:`kvstrata.store.placements`: the client checks copies it started early).
    """
    if not s.shm:
        raise ServerError("zero-copy buffers need shared memory: connect over unix:// on the worker's node")
    keys = P.check_keys(msg.get("keys", []))
    ids, locs, mutable, placed, errors = s.store.lease_many(
        keys, owner=s.owner, timeout=P.check_timeout(msg.get("timeout", 0))
    )
    flat = list(chain.from_iterable(locs))
    if msg.get("cache"):  # the client may keep cacheable leases for later local views
        # validity.cacheable and validity.slot_of, inline: sealed (immutable) and TTL-free
        no_ttl, mask = s.validity.no_ttl, SLOTS - 1
        flags = [1 if m else 2 + (hash(k) & mask) if k in no_ttl else 0 for k, m in zip(keys, mutable)]
    else:
        flags = list(map(int, mutable))
    s.leases.update(ids)
    reply: dict = {}
    if errors:
        s.leases.discard(0)
        errs = []
        for i, exc in sorted(errors.items()):
            flags[i] = 0
            errs.append([i, *P.error_record(exc)["err"]])
        reply["errs"] = errs
    s.new_segments(flat, reply)
    column = P.int_column if msg.get("cols") else list  # (the integer columns as bytes: protocol, "columns")
    reply["ids"], reply["locs"], reply["flags"] = column(ids), column(flat), column(flags)
    if msg.get("placements"):
        reply["placed"] = column(placed)
    return reply


def release(s: Session, msg: dict) -> dict:
    leases = s.leases
    mine = leases.intersection(P.check_ids(msg.get("ids", ())))  # only what this client was given
    leases -= mine
    if hasattr(s.store, "release_many"):
        s.store.release_many(mine)
    else:
        for lease_id in mine:
            s.store.release(lease_id)
    return {}


def _read(s: Session, msg: dict) -> dict:
    key = P.check_key(msg.get("key"))
    offset, size = P.check_size(msg.get("offset"), "offset"), P.check_size(msg.get("size"))
    return {"v": attach(s.store.read(key, offset, size))}


def _keys_op(method: str):
    def handle(s: Session, msg: dict) -> dict:
        keys = P.check_keys(msg.get("keys", []))
        if method in ("exists", "sizes", "incref"):  # nothing visible changes
            return {"r": list(getattr(s.store, method)(keys))}
        with s.validity.change(keys):
            if method != "expire":  # delete, decref
                return {"r": list(getattr(s.store, method)(keys))}
            result = list(s.store.expire(keys, P.check_ttl(msg.get("ttl"))))
            for key in keys:
                with s.validity.key_lock(key):
                    s.validity.ttl_changed(key)
            return {"r": result}

    return handle


def _refcount(s: Session, msg: dict) -> dict:
    return {"r": s.store.refcount(P.check_key(msg.get("key")))}


def _stats(s: Session, msg: dict) -> dict:
    # "asker": the connection that asked, as the stats count it, so that it can leave itself out of them
    # (kvstrata status --prometheus) even where the client list, cut short, does not name it
    asker = {"name": s.name, "pid": s.pid, "counted": not s.devobj_link}
    return {"stats": s.worker.stats(), "asker": asker}


def _flush(s: Session, msg: dict) -> dict:
    s.store.flush()
    return {}


def _segments(s: Session, msg: dict) -> dict:
    """Descriptors of segments the client lacks (after a reconnect, say)."""
    want = P.check_ids(msg.get("indices", []), "indices")
    n, retired = len(s.store.segments), s.store.retired_segments
    reply: dict = {"_segs": [i for i in want if 0 <= i < n and i not in retired]}
    return reply


def _ping(s: Session, msg: dict) -> dict:
    return {"pong": True}


def _linger(s: Session, msg: dict) -> dict:
    """One-way: nothing to do but what every request's ``"linger"`` field does (Session.handle): keep this
    connection's thread polling that long, so the client's next request (a device write's commit after its
    bytes land) does not wait for a sleeping thread to wake."""
    return {}


HANDLERS = {
    "put": _put,
    "mput": _mput,
    "create": _create,
    "mcreate": _mcreate,
    "seal": _finish("seal"),
    "publish": _finish("publish"),
    "abort": _finish("abort"),
    "mseal": _mseal,
    "reserve": _reserve,
    "commit": _commit,
    "get": _get,
    "mget": _mget,
    "acquire": _acquire,
    "release": release,
    "read": _read,
    "delete": _keys_op("delete"),
    "exists": _keys_op("exists"),
    "expire": _keys_op("expire"),
    "sizes": _keys_op("sizes"),
    "incref": _keys_op("incref"),
    "decref": _keys_op("decref"),
    "refcount": _refcount,
    "stats": _stats,
    "flush": _flush,
    "segments": _segments,
    "ping": _ping,
    "linger": _linger,
    "dev": devobj_service.handle,  # device objects: kvstrata.devobj
}
