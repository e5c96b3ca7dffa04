"""Request handlers of the worker: one function per protocol op, ``(session, message) -> reply``.

Each validates its fields (ValueError/TypeError naming them), calls the engine with the session as
``owner``, and returns the reply fields; the session turns exceptions into error records. Batch
handlers answer per key. See :mod:`kvstrata.server.protocol` for the message shapes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstrata.devobj import service as devobj_service
from kvstrata.errors import KvstrataError, ServerError
from kvstrata.server import protocol as P

if TYPE_CHECKING:
    from kvstrata.server.worker import Session


def _value(msg: dict) -> bytes:
    v = msg.get("v")
    if not isinstance(v, bytes):
        raise TypeError(f"value: expected bytes on the wire, got {type(v).__name__}")
    return v


def _put(s: Session, msg: dict) -> dict:
    key = P.check_key(msg.get("key"))
    s.store.put(key, _value(msg), owner=s.owner, **s.write_options(msg))
    return {}


def _mput(s: Session, msg: dict) -> dict:
    opts = s.write_options(msg)
    items = []
    for key, value in msg.get("items", []):
        try:
            s.store.put(P.check_key(key), _value({"v": value}), owner=s.owner, **opts)
            items.append({})
        except (KvstrataError, ValueError, TypeError) as exc:
            items.append(P.error_record(exc))
    return {"items": items}


def _create(s: Session, msg: dict) -> dict:
    key = P.check_key(msg.get("key"))
    size = P.check_size(msg.get("size"))
    location = s.store.create(key, size, owner=s.owner, **s.write_options(msg))
    s.writes.add(key)
    reply: dict = {}
    reply["loc"] = s.loc(location, reply)
    return reply


def _mcreate(s: Session, msg: dict) -> dict:
    opts = s.write_options(msg)
    reply: dict = {}
    items = []
    for key, size in msg.get("items", []):
        try:
            location = s.store.create(P.check_key(key), P.check_size(size), owner=s.owner, **opts)
            s.writes.add(key)
            items.append({"loc": s.loc(location, reply)})
        except (KvstrataError, ValueError, TypeError) as exc:
            items.append(P.error_record(exc))
    reply["items"] = items
    return reply


def _finish(action: str):
    def handle(s: Session, msg: dict) -> dict:
        key = P.check_key(msg.get("key"))
        getattr(s.store, action)(key, owner=s.owner)
        s.writes.discard(key)
        return {}

    return handle


def _mfinish(action: str):
    def handle(s: Session, msg: dict) -> dict:
        items = []
        for key in P.check_keys(msg.get("keys", [])):
            try:
                getattr(s.store, action)(key, owner=s.owner)
                s.writes.discard(key)
                items.append({})
            except (KvstrataError, ValueError, TypeError) as exc:
                items.append(P.error_record(exc))
        return {"items": items}

    return handle


def _get(s: Session, msg: dict) -> dict:
    key = P.check_key(msg.get("key"))
    lease = s.store.acquire(key, owner=s.owner, timeout=P.check_timeout(msg.get("timeout")))
    reply: dict = {}
    reply.update(s.lease_item(lease, reply))
    return reply


def _mget(s: Session, msg: dict) -> dict:
    keys = P.check_keys(msg.get("keys", []))
    reply: dict = {}
    items = []
    for result in s.store.acquire_many(keys, owner=s.owner, timeout=P.check_timeout(msg.get("timeout"))):
        items.append(P.error_record(result) if isinstance(result, BaseException) else s.lease_item(result, reply))
    reply["items"] = items
    return reply


def _acquire(s: Session, msg: dict) -> dict:
    """Leases for zero-copy views, never inlined (``get_buffers``)."""
    if not s.shm:
        raise ServerError("zero-copy buffers need shared memory: connect over unix:// on the worker's node")
    keys = P.check_keys(msg.get("keys", []))
    reply: dict = {}
    items = []
    for result in s.store.acquire_many(keys, owner=s.owner, timeout=P.check_timeout(msg.get("timeout"))):
        if isinstance(result, BaseException):
            items.append(P.error_record(result))
        else:
            s.leases.add(result.lease_id)
            items.append({"lease": result.lease_id, "loc": s.loc(result.location, reply), "mutable": result.mutable})
    reply["items"] = items
    return reply


def release(s: Session, msg: dict) -> dict:
    for lease_id in msg.get("ids", []):
        if lease_id in s.leases:  # only what this client was given
            s.leases.discard(lease_id)
            s.store.release(lease_id)
    return {}


def _read(s: Session, msg: dict) -> dict:
    key = P.check_key(msg.get("key"))
    offset, size = P.check_size(msg.get("offset"), "offset"), P.check_size(msg.get("size"))
    return {"v": s.store.read(key, offset, size)}


def _keys_op(method: str):
    def handle(s: Session, msg: dict) -> dict:
        keys = P.check_keys(msg.get("keys", []))
        if method == "expire":
            return {"r": list(s.store.expire(keys, P.check_ttl(msg.get("ttl"))))}
        return {"r": list(getattr(s.store, method)(keys))}

    return handle


def _refcount(s: Session, msg: dict) -> dict:
    return {"r": s.store.refcount(P.check_key(msg.get("key")))}


def _stats(s: Session, msg: dict) -> dict:
    return {"stats": s.worker.stats()}


def _flush(s: Session, msg: dict) -> dict:
    s.store.flush()
    return {}


def _segments(s: Session, msg: dict) -> dict:
    """Descriptors of segments the client lacks (after a reconnect, say)."""
    want = [int(i) for i in msg.get("indices", [])]
    n = len(s.store.segments)
    reply: dict = {"_segs": [i for i in want if 0 <= i < n]}
    return reply


def _ping(s: Session, msg: dict) -> dict:
    return {"pong": True}


HANDLERS = {
    "put": _put,
    "mput": _mput,
    "create": _create,
    "mcreate": _mcreate,
    "seal": _finish("seal"),
    "publish": _finish("publish"),
    "abort": _finish("abort"),
    "mseal": _mfinish("seal"),
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
    "dev": devobj_service.handle,  # device objects: kvstrata.devobj
}
