"""The transport interface: a message :class:`Connection`, a :class:`Listener`, and the backend registry.

A message is a ``dict`` of msgpack-able values (``bytes`` travel as bytes), optionally with open
file descriptors attached (``fds``; only where the backend can pass them, ``unix://``). Received
descriptors belong to the receiver, which must close them. Backends are picked by the address
scheme (``unix:///run/kvstrata.sock``, ``inproc://name``, ``tcp://host:port``); each registers a
:class:`Backend` here, so the server and client never name a concrete socket type.

Error contract, the same for every backend: the peer went away -> :class:`ConnectionLost`; this
side closed the connection -> :class:`ClosedError`; no whole message arrived before ``timeout`` ->
:class:`Timeout` (the connection stays usable: a message cut short is kept, and the next ``recv``
continues it); garbage on the wire, a frame over the size limit or a version mismatch ->
:class:`ProtocolError` (the connection is lost); could not connect -> :class:`TransportError`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

from kvstrata.errors import InvalidValue, TransportError

# Raised on every change that makes old peers misread new messages (2: frames may carry attachments, stream.py).
PROTOCOL_VERSION = 2

Message = dict[str, Any]
Handler = Callable[["Connection"], None]


class Connection(abc.ABC):
    """A bidirectional, ordered, reliable message channel. ``send`` and ``recv`` are each thread-safe."""

    #: what the peer said in the handshake (``{"protocol": 2, ...}``); empty before it
    peer_info: Message
    #: descriptors the peer attached to its handshake message (owned by this side)
    handshake_fds: list[int]
    can_pass_fds: bool = False

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """The address this connection was made to or accepted on."""

    @abc.abstractmethod
    def send(self, msg: Message, fds: Sequence[int] = ()) -> None:
        """Send one message; ``fds`` are duplicated into the peer (the caller keeps its own)."""

    @abc.abstractmethod
    def recv(
        self, timeout: float | None = None, *, spin: float = 0.0, max_bytes: int | None = None
    ) -> tuple[Message, list[int]]:
        """The next message and the descriptors attached to it; waits up to ``timeout`` seconds (None: forever).

        ``timeout`` bounds the whole message, not only the wait for its first byte: a peer that stops
        halfway through a frame gets :class:`Timeout` raised here, and the part read is kept for the next call.
        ``spin``: busy-poll up to this many seconds before sleeping (a hint; backends may ignore it).
        It trades CPU for latency: only worth it while the machine has an idle core for the poller.
        ``max_bytes``: a message's largest encoded size (None: the backend's limit, 1 GiB); a larger one
        is a :class:`ProtocolError`. For peers not trusted yet, such as a listener's first message.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Close this side (idempotent); the peer's next ``recv`` raises ConnectionLost."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """True once :meth:`close` was called or the peer was seen to go away."""

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.address} {'closed' if self.closed else 'open'}>"


class Listener(abc.ABC):
    """Accepts connections on an address and hands each one, already handshaken, to a handler thread."""

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """The address clients connect to (a ``tcp://host:0`` listener reports its real port)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop accepting (idempotent); connections already handed out stay open."""

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Backend(abc.ABC):
    """One address scheme: how to open a raw connection and how to listen."""

    @abc.abstractmethod
    def connect(self, address: str, timeout: float) -> Connection:
        """One attempt; raises OSError subclasses (refused, missing) that ``connect`` retries."""

    @abc.abstractmethod
    def listen(self, address: str, accept: Handler, **options: Any) -> Listener:
        """Bind and start accepting; ``accept`` is called (in the accept thread) with each raw connection."""


_BACKENDS: dict[str, Backend] = {}


def register_backend(scheme: str, backend: Backend) -> None:
    """Make ``scheme://...`` addresses use ``backend`` (a later registration replaces an earlier one)."""
    _BACKENDS[scheme] = backend


def split_address(address: str) -> tuple[str, str]:
    """``"unix:///a/b.sock"`` -> ``("unix", "/a/b.sock")``; ValueError naming ``address`` otherwise."""
    if not isinstance(address, str) or "://" not in address:
        raise InvalidValue(f"address must look like 'scheme://location', got {address!r}")
    scheme, _, location = address.partition("://")
    if not location:
        raise InvalidValue(f"address {address!r} has no location after '{scheme}://'")
    return scheme, location


def get_backend(address: str) -> Backend:
    scheme, _ = split_address(address)
    try:
        return _BACKENDS[scheme]
    except KeyError:
        known = ", ".join(sorted(_BACKENDS)) or "none"
        raise TransportError(f"no transport for scheme {scheme!r} in {address!r} (known: {known})") from None
