"""Records the device-object broker keeps and answers with: error codes, objects, waiters.

Shared by :mod:`kvstrata.devobj.broker` and its broadcast planning (:mod:`kvstrata.devobj.bcast_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Error codes carried in results and events; the client maps them to exceptions.
E_NOT_FOUND = "KeyNotFound"
E_EXISTS = "KeyExists"
E_TIMEOUT = "Timeout"
E_MISMATCH = "Mismatch"
E_OWNER_GONE = "OwnerGone"
E_NOT_OWNER = "NotOwner"
E_ABORTED = "Aborted"
E_BAD_REQUEST = "BadRequest"

MODES = ("oneshot", "mset", "broadcast")


@dataclass(slots=True)
class _Object:
    record: dict[str, Any]
    lean: dict[str, Any]  # the record less SHARED_FIELDS, "key", "tensors" (the receiver knows them), empty "events"
    shared: dict[str, Any]  # SHARED_FIELDS of the record, one dict for all objects of its client and mode
    state: str = "ready"  # ready | claimed | deleting | offered (its fate asked of offered_to's client)
    transfers: set[int] = field(default_factory=set)  # tids in flight reading this object
    readers: set[str] = field(default_factory=set)  # clients that read it (to invalidate their caches)
    pending: list[tuple[str, int]] = field(default_factory=list)  # broadcast: (client, wid) in arrival order
    done: set[int] = field(default_factory=set)  # broadcast: positions that completed
    #: a publish whose offer went to a receive that no longer waits: (that client, wid), until it says whether it
    #: took the offer (kvstrata.devobj.offers); ``state`` is ``offered`` meanwhile, or the object is a side object
    offered_to: tuple[str, int] | None = None


@dataclass
class _Waiter:
    wid: int
    client: str
    key: str
    kind: str  # sub | get
    specs: list[dict[str, Any]] | None
    deadline: float | None
    offerable: bool = False  # hinted to publishers while first in line (a subscribe of few keys, see offers)


def _err(code: str, message: str) -> dict[str, Any]:
    return {"ok": False, "error": code, "message": message}


__all__ = ["E_ABORTED", "E_BAD_REQUEST", "E_EXISTS", "E_MISMATCH", "E_NOT_FOUND", "E_NOT_OWNER", "E_OWNER_GONE",
           "E_TIMEOUT", "MODES", "_Object", "_Waiter", "_err"]  # fmt: skip
