"""kvstrata's exception hierarchy.

One root, :class:`KvstrataError`. Below it two branches users catch differently:

* :class:`TransportError` (also an :class:`OSError`): the connection to a worker broke or could not be
  made. Retryable: the request may or may not have reached the worker.
* :class:`ServerError`: the worker understood the request and refused it; retrying the same request
  gives the same answer.

Plus the specific conditions users test for (:class:`KeyNotFound`, :class:`Timeout`, ...). A bad
argument raises :class:`InvalidValue` (a :class:`ValueError`) or :class:`InvalidType` (a
:class:`TypeError`), both :class:`InvalidArgument`, with the argument's name in the message, before
anything is written: ``except ValueError`` and ``except kvstrata.KvstrataError`` both catch it.

>>> import kvstrata
>>> with kvstrata.connect(embedded=True, memory_bytes="64MiB") as kv:
...     try:
...         kv.set("", b"x")
...     except kvstrata.InvalidArgument as exc:
...         print(type(exc).__name__, "-", exc)
InvalidValue - key: must not be empty
"""

from __future__ import annotations


class KvstrataError(Exception):
    """Root of every error kvstrata raises on purpose."""


class TransportError(KvstrataError, OSError):
    """The link to a worker broke or could not be set up (retryable)."""


class ConnectionLost(TransportError):
    """The worker went away in the middle of a request."""


class ServerError(KvstrataError):
    """The worker refused a request; the message says why."""


class KeyNotFound(ServerError, KeyError):
    """A key does not exist (or expired, or was evicted as evictable)."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the message as written
        return str(self.args[0]) if self.args else "key not found"


class KeyExists(ServerError):
    """A write-once or ``nx`` write found the key already present."""


class NotOwner(ServerError):
    """A cluster worker refused a write of a key it does not own under its member list, which is not the list the
    client routed the write by (the client's view of the cluster was out of date). A
    :class:`~kvstrata.client.cluster.ClusterClient` re-reads the list and writes the key to its owners; a caller
    sees it only where the lists still disagree after that."""


class OwnerGone(ServerError):
    """The process that owned a device object went away (closed, died, lost its worker connection): its keys
    vanished, and receives of them failed or were dropped. The message starts with ``OwnerGone:``."""


class TransferAborted(ServerError):
    """A device object's copy was abandoned by the broker: the broadcast it belonged to failed, or the NCCL pair it
    travelled on broke. Nothing half-received is reported done; the message says why and starts with ``Aborted:``."""


class Timeout(KvstrataError, TimeoutError):
    """A wait (for a key, a peer, a transfer) ran past its deadline."""


class CapacityError(ServerError):
    """A tier, or the whole store, has no room for the request even after eviction."""


class CorruptData(KvstrataError):
    """Stored bytes failed their checksum or were truncated; they are never served."""


class ClosedError(KvstrataError):
    """The client, worker or object was closed or released before this call."""


class InvalidArgument(KvstrataError):
    """A call's argument was wrong; the message names it, and nothing was written or copied."""


class InvalidValue(InvalidArgument, ValueError):
    """An argument of the right type with a wrong value (an empty key, a size that does not match)."""


class InvalidType(InvalidArgument, TypeError):
    """An argument of the wrong type (a str where bytes go, a CPU tensor where a CUDA one must be)."""


class DeadlockError(KvstrataError, RuntimeError):
    """A wait that could never end, refused: a receive's ``result()`` awaited in a callback on the thread
    that must deliver it."""


class ProtocolError(TransportError):
    """The peer spoke a protocol version or message this side does not understand."""


class AuthenticationError(KvstrataError, PermissionError):
    """A worker that asks for a token (``--auth-token-file``, ``$KVSTRATA_TOKEN``) refused this connection: no token
    given, or not the worker's. Not a worker out of reach: every try with the same token fails the same way."""


__all__ = [
    "AuthenticationError",
    "CapacityError",
    "ClosedError",
    "ConnectionLost",
    "CorruptData",
    "DeadlockError",
    "InvalidArgument",
    "InvalidType",
    "InvalidValue",
    "KeyExists",
    "KeyNotFound",
    "KvstrataError",
    "NotOwner",
    "ProtocolError",
    "ServerError",
    "Timeout",
    "TransportError",
]
