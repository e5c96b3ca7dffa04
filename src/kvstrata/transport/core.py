"""``connect`` and ``listen``: backends chosen by address scheme, retries, and the version handshake.

A listener given a ``token`` (a worker's TCP listeners with ``--auth-token-file`` or ``$KVSTRATA_TOKEN``) answers
each hello with a challenge: a fresh random nonce, to which the client answers HMAC-SHA256(token, nonce). The token
never crosses the wire and an answer overheard is worth nothing for the next connection; a client with no token or
another one is refused (:class:`~kvstrata.errors.AuthenticationError`) before the worker does anything for it.
It authenticates; it does not encrypt: the data that follows crosses the network as it is (run the cluster on a
network you trust, or under a VPN or WireGuard).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstrata.errors import (
    AuthenticationError,
    ConnectionLost,
    InvalidValue,
    KvstrataError,
    ProtocolError,
    TransportError,
)
from kvstrata.transport.base import PROTOCOL_VERSION, Connection, Handler, Listener, Message, get_backend

log = logging.getLogger(__name__)

#: hello -> (extra fields for the reply, fds to attach); lets a server hand out its state in the handshake
HelloHook = Callable[[Connection, Message], tuple[Message, Sequence[int]]]

HANDSHAKE_TIMEOUT = 10.0  # seconds a new connection has to send its whole hello
#: The largest hello a listener reads. Until its handshake a peer is nobody: it must not get to make the
#: listener hold a frame of the 1 GiB any frame may have (clients' hellos are a few hundred bytes).
HELLO_MAX_BYTES = 1 << 16
#: at most one warning per this many seconds about clients turned away for want of resources (a burst of clients
#: past the worker's descriptor limit would otherwise log a line each)
REFUSAL_LOG_EVERY_S = 10.0
#: the environment variable a client's token comes from, where its connect is given none
TOKEN_ENV = "KVSTRATA_TOKEN"
#: bytes of a challenge's nonce
NONCE_BYTES = 32
_AUTH_CONTEXT = b"kvstrata-auth-v1:"
#: errors that say the process (EMFILE) or the system (ENFILE) has no descriptor left to give
OUT_OF_FDS_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE})

# What a connect attempt may meet that heals by itself: nothing listening yet, the socket file not there
# yet, a reset, a timeout, and a full accept backlog (a unix socket's connect fails with EAGAIN at once then).
_RETRIED_CONNECT_ERRORS = (
    ConnectionRefusedError,
    FileNotFoundError,
    ConnectionResetError,
    TimeoutError,
    BlockingIOError,
    InterruptedError,
)


class HelloRefused(TransportError):
    """Raised by a listener's ``on_hello`` hook to turn a client away for now (the worker out of file descriptors):
    the client's ``connect`` raises :class:`~kvstrata.errors.ConnectionLost` with this message as the reason."""


def out_of_fds_reason(exc: OSError, detail: str = "") -> str:
    """What a client turned away for want of descriptors is told: whose limit ran out and how to raise it.

    ``exc``: the EMFILE or ENFILE error; ``detail``: what the server adds (how many clients it holds).
    """
    if exc.errno == errno.ENFILE:
        return f"the worker's system is out of file descriptors (ENFILE){detail}; raise fs.file-max (sysctl)"
    try:
        import resource

        limit = f" (now {resource.getrlimit(resource.RLIMIT_NOFILE)[0]})"
    except (ImportError, OSError, ValueError):
        limit = ""
    return f"worker out of file descriptors (EMFILE){detail}; raise its ulimit -n{limit}"


class _RefusalLog:
    """One warning per :data:`REFUSAL_LOG_EVERY_S` about clients turned away, counting those it stood for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unlogged = 0
        self._logged_at = -REFUSAL_LOG_EVERY_S

    def note(self, address: str, why: str) -> None:
        with self._lock:
            self._unlogged += 1
            now = time.monotonic()
            if now - self._logged_at < REFUSAL_LOG_EVERY_S:
                return
            count, self._unlogged, self._logged_at = self._unlogged, 0, now
        log.warning(
            "turned away %d client(s) on %s since the last warning: %s; still serving the others", count, address, why
        )


_refusals = _RefusalLog()


def connect(
    address: str,
    timeout: float = 10.0,
    *,
    hello: Message | None = None,
    retry_delay: float = 0.01,
    max_retry_delay: float = 0.5,
    token: str | bytes | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> Connection:
    """Connect to ``address`` and handshake, retrying with jittered backoff until ``timeout`` seconds pass.

    Retries only what may heal by itself (nothing listening yet, socket file not there yet, reset, the
    listener's accept backlog full).
    The handshake sends ``{"op": "hello", "protocol": PROTOCOL_VERSION, **hello}``; the reply is in
    ``conn.peer_info`` and any descriptors attached to it in ``conn.handshake_fds``. ``token``: what to answer a
    listener's challenge with (default ``$KVSTRATA_TOKEN``; see the module). ``cancelled``: asked before each retry;
    True ends the tries at once (TransportError saying so): a caller whose work was called off meanwhile.

    >>> from kvstrata.transport import connect, listen
    >>> lst = listen("inproc://*", lambda c: c.send(c.recv()[0]))
    >>> with connect(lst.address, timeout=1) as c:
    ...     c.send({"x": 1}); c.recv()[0]
    {'x': 1}
    >>> lst.stop()
    """
    if timeout is None or timeout <= 0:
        raise InvalidValue(f"timeout must be > 0 seconds, got {timeout!r}")
    backend = get_backend(address)
    deadline = time.monotonic() + timeout
    delay = retry_delay
    attempt = 0
    while True:
        attempt += 1
        left = deadline - time.monotonic()
        try:
            conn = backend.connect(address, max(left, 0.001))
            break
        except _RETRIED_CONNECT_ERRORS as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(
                    f"could not connect to {address} within {timeout:.3g} s ({attempt} attempts; last: {exc})"
                ) from exc
            if cancelled is not None and cancelled():
                why = f"connecting to {address} was called off ({attempt} attempts; last: {exc})"
                raise TransportError(why) from exc
            time.sleep(min(left, delay * random.uniform(0.5, 1.5)))
            delay = min(delay * 2, max_retry_delay)
        except OSError as exc:
            raise TransportError(f"could not connect to {address}: {exc}") from exc
    try:
        secret = _as_token(token if token is not None else os.environ.get(TOKEN_ENV), "token")
        _client_handshake(conn, hello or {}, max(deadline - time.monotonic(), 0.5), secret)
    except BaseException:
        conn.close()
        raise
    return conn


def _as_token(token: str | bytes | None, name: str) -> bytes | None:
    """A token as bytes (None or empty: none); InvalidValue for anything but a str or bytes."""
    if token is None:
        return None
    if isinstance(token, str):
        token = token.strip().encode()
    if not isinstance(token, bytes):
        raise InvalidValue(f"{name}: a str or bytes, got {type(token).__name__}")
    return token or None


def answer(token: bytes, nonce: bytes) -> bytes:
    """The answer to a challenge's ``nonce`` with ``token``: HMAC-SHA256, bound to kvstrata's handshake."""
    return hmac.new(token, _AUTH_CONTEXT + nonce, hashlib.sha256).digest()


def _client_handshake(conn: Connection, hello: Message, timeout: float, token: bytes | None = None) -> None:
    conn.send({**hello, "op": "hello", "protocol": PROTOCOL_VERSION, "pid": os.getpid()})
    reply, fds = _handshake_reply(conn, timeout)
    if reply.get("op") == "challenge":
        nonce = reply.get("nonce")
        if token is None:
            raise AuthenticationError(
                f"{conn.address} asks for a token: set ${TOKEN_ENV} to the cluster's (the worker's --auth-token-file)"
            )
        if not isinstance(nonce, bytes) or len(nonce) < 16:
            raise ProtocolError(f"{conn.address} sent a malformed challenge")
        conn.send({"op": "auth", "mac": answer(token, nonce)})
        reply, fds = _handshake_reply(conn, timeout)
        if reply.get("op") == "refused" and reply.get("auth"):
            raise AuthenticationError(f"{conn.address} refused the token: {reply.get('error')}")
    if reply.get("op") != "welcome":
        for fd in fds:
            os.close(fd)
        why = reply.get("error") or f"unexpected reply {reply!r:.200}"
        if reply.get("op") == "refused" and reply.get("busy"):  # turned away for now (out of descriptors)
            raise ConnectionLost(f"{conn.address} turned the connection away: {why}")
        raise ProtocolError(f"{conn.address} refused the handshake: {why}")
    conn.peer_info = reply
    conn.handshake_fds = fds


def _handshake_reply(conn: Connection, timeout: float) -> tuple[Message, list[int]]:
    try:
        return conn.recv(timeout=timeout)
    except KvstrataError as exc:
        if isinstance(exc, TransportError):
            raise
        raise TransportError(f"no handshake from {conn.address}: {exc}") from exc


def _challenge(conn: Connection, token: bytes) -> bool:
    """Ask the client that sent a hello to prove it holds ``token``; whether it did (if not, it was told why)."""
    nonce = os.urandom(NONCE_BYTES)
    try:
        conn.send({"op": "challenge", "nonce": nonce, "scheme": "hmac-sha256"})
        reply, fds = conn.recv(timeout=HANDSHAKE_TIMEOUT, max_bytes=HELLO_MAX_BYTES)
    except KvstrataError as exc:  # (a client with no token gives up here: it raised AuthenticationError)
        log.debug("no answer to the challenge from a client on %s: %s", conn.address, exc)
        return False
    for fd in fds:
        os.close(fd)
    mac = reply.get("mac") if reply.get("op") == "auth" else None
    if isinstance(mac, bytes) and hmac.compare_digest(mac, answer(token, nonce)):
        return True
    _refusals.note(conn.address, "a client's token was not this worker's (authentication failed)")
    try:
        conn.send({"op": "refused", "error": "authentication failed: not this worker's token", "auth": True})
    except KvstrataError:
        pass
    return False


def _server_handshake(
    conn: Connection,
    on_hello: HelloHook | None,
    on_abandon: Callable[[Connection], None] | None = None,
    token: bytes | None = None,
) -> bool:
    try:
        hello, fds = conn.recv(timeout=HANDSHAKE_TIMEOUT, max_bytes=HELLO_MAX_BYTES)
    except KvstrataError as exc:
        log.debug("no hello from a client on %s (dropped): %s", conn.address, exc)
        return False
    for fd in fds:
        os.close(fd)
    if hello.get("op") != "hello" or hello.get("protocol") != PROTOCOL_VERSION:
        why = (
            f"protocol version {hello.get('protocol')!r} not supported (this worker speaks {PROTOCOL_VERSION})"
            if hello.get("op") == "hello"
            else "the first message must be a hello"
        )
        log.warning("refused a client on %s: %s", conn.address, why)
        try:
            conn.send({"op": "refused", "error": why})
        except KvstrataError:
            pass
        return False
    if token is not None and not _challenge(conn, token):
        return False
    conn.peer_info = hello
    try:
        extra, reply_fds = on_hello(conn, hello) if on_hello else ({}, ())
    except HelloRefused as exc:
        _turn_away(conn, str(exc))
        return False
    except OSError as exc:
        if exc.errno not in OUT_OF_FDS_ERRNOS:
            raise
        _turn_away(conn, out_of_fds_reason(exc))  # (what the hook opened for the client failed: it holds nothing)
        return False
    try:
        conn.send({**extra, "op": "welcome", "protocol": PROTOCOL_VERSION, "pid": os.getpid()}, reply_fds)
    except BaseException:
        # the peer left before its welcome: what on_hello set up for it (a lane, say) will see no handler
        if on_abandon is not None:
            on_abandon(conn)
        raise
    return True


def _turn_away(conn: Connection, why: str) -> None:
    """Tell a client why it cannot be served now (its connect raises ConnectionLost saying so); one warning a burst."""
    _refusals.note(conn.address, why)
    try:
        conn.send({"op": "refused", "error": why, "busy": True})
    except KvstrataError:  # gone already
        pass


def listen(
    address: str,
    handler: Handler,
    *,
    on_hello: HelloHook | None = None,
    on_abandon: Callable[[Connection], None] | None = None,
    token: str | bytes | None = None,
    **options: Any,
) -> Listener:
    """Listen on ``address``; each connection is handshaken, then ``handler(conn)`` runs in its own thread.

    The handler owns the connection (close it when done). ``options`` go to the backend
    (``mode=0o600`` for ``unix://``). ``on_hello`` may add fields and descriptors to the handshake reply;
    ``on_abandon(conn)`` undoes what it set up where the welcome could not be sent (no handler runs then).
    ``token``: serve only clients that prove they hold it (see the module).
    """
    secret = _as_token(token, "token")

    def serve(conn: Connection) -> None:
        try:
            if _server_handshake(conn, on_hello, on_abandon, secret):
                handler(conn)
                return
        except KvstrataError as exc:
            log.debug("connection on %s ended during the handshake: %s", conn.address, exc)
        except Exception:
            log.exception("connection handler on %s failed", conn.address)
        conn.close()

    def accept(conn: Connection) -> None:
        threading.Thread(target=serve, args=(conn,), name=f"kvstrata-conn {conn.address}", daemon=True).start()

    return get_backend(address).listen(address, accept, **options)
