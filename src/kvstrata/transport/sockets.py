"""``unix://`` and ``tcp://`` backends: stream sockets carrying :mod:`kvstrata.transport.stream` frames.

``unix:///path.sock`` is the node-local transport: it can pass file descriptors (the shared memory
segments) and its socket file is created with mode 0600, so only the worker's user can connect.
A stale socket file left by a killed worker is replaced; a live one is an error. A listener removes its
socket file when it stops, unless another listener's has taken that path since. A client connects only to a
socket in a folder named for its user (``/tmp/kvstrata-<uid>``, the default's) only if its listener runs as that
user or root (``SO_PEERCRED``): another user's (a squatted folder) is a :class:`ForeignSocketError`.
``tcp://host:port`` is for the cluster mode; it cannot pass descriptors. Its sockets keep alive
(TCP keepalive and a user timeout): a peer whose host vanished is found gone within about a minute,
rather than holding its connection open forever.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import stat
import struct
import threading
import time
from typing import Any

from kvstrata.errors import InvalidValue, TransportError
from kvstrata.transport.base import Backend, Handler, Listener, register_backend, split_address
from kvstrata.transport.core import OUT_OF_FDS_ERRNOS, out_of_fds_reason
from kvstrata.transport.stream import StreamConnection, encode_frame

log = logging.getLogger(__name__)

# accept() failures that say nothing about the listening socket, so the loop goes on: out of descriptors
# or memory for now (EMFILE after a burst of clients: it pauses, as descriptors free up when peers leave),
# or one peer's trouble: gone before it was taken, or, for TCP, a network error of that peer passed on
# (Linux's accept(2) asks to treat those like EAGAIN).
_ACCEPT_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_ACCEPT_TRANSIENT_ERRNOS = _ACCEPT_OUT_OF_RESOURCES | frozenset(
    getattr(errno, name)
    for name in (
        "ECONNABORTED", "EINTR", "EAGAIN", "EPERM", "EPROTO", "ENETDOWN", "ENOPROTOOPT", "EHOSTDOWN", "ENONET",
        "EHOSTUNREACH", "EOPNOTSUPP", "ENETUNREACH",
    )
    if hasattr(errno, name)
)  # fmt: skip
ACCEPT_RETRY_S = 0.05  # the accept loop's pause when out of descriptors or memory
#: how long the accept loop waits for a client it turns away to send its hello (a few ms after its connect)
TURN_AWAY_HELLO_WAIT_MS = 100
#: the most bytes a client turned away at accept may have sent (its hello) that are read and dropped before the refusal,
#: so that closing the socket does not reset the connection under the refusal (TCP)
_TURNED_AWAY_READ_MAX = 1 << 16
ACCEPT_LOG_EVERY_S = 10.0  # at most one warning per this many seconds of failed accepts

# TCP keepalive: an idle connection is probed after KEEPIDLE s, every KEEPINTVL s, and dropped after
# KEEPCNT probes go unanswered; the user timeout drops it when sent data stays unacknowledged as long. That
# includes data a live peer does not read (a zero window: a client paused in a debugger, or busy): so minutes,
# not the keepalive's minute, which finds a vanished idle peer.
TCP_KEEPIDLE_S = 30
TCP_KEEPINTVL_S = 10
TCP_KEEPCNT = 3
TCP_USER_TIMEOUT_S = 600


class ForeignSocketError(TransportError, PermissionError):
    """The process listening on a Unix socket runs as another user (not root): a client talking to it would hand
    that user its data, so it does not."""


def tune_tcp(sock: socket.socket) -> None:
    """Set a TCP connection's options: no Nagle delay, keepalive probes and a user timeout (where the platform has
    them), so an idle peer whose host vanished without a FIN or RST is found gone in about a minute, and one that
    leaves data sent to it unacknowledged (vanished, or not reading) in ten."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", TCP_KEEPIDLE_S),
        ("TCP_KEEPINTVL", TCP_KEEPINTVL_S),
        ("TCP_KEEPCNT", TCP_KEEPCNT),
        ("TCP_USER_TIMEOUT", TCP_USER_TIMEOUT_S * 1000),  # (in milliseconds)
    ):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


class StreamListener(Listener):
    """Accept loop on a listening socket, in a daemon thread."""

    def __init__(
        self,
        sock: socket.socket,
        address: str,
        accept: Handler,
        cleanup_path: str | None = None,
        cleanup_id: tuple[int, ...] | None = None,
    ) -> None:
        self._sock = sock
        self._address = address
        self._accept = accept
        #: the socket file to remove at stop, and its (st_dev, st_ino): removed only while it is still ours
        self._cleanup_path = cleanup_path
        self._cleanup_id = cleanup_id
        self._stopped = threading.Event()
        # A descriptor held in reserve: out of descriptors, accept() leaves clients waiting in the backlog until
        # their connect times out with no reason given, so it is given up to take one at a time and tell it why.
        self._spare_fd = _open_spare()
        # A timeout lets the loop notice stop(): closing a socket does not wake accept() on Linux.
        sock.settimeout(0.2)
        self._thread = threading.Thread(target=self._run, name=f"kvstrata-accept {address}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return self._address

    def _run(self) -> None:
        failures, turned_away, logged_at = 0, 0, -ACCEPT_LOG_EVERY_S
        while not self._stopped.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stopped.is_set():
                    return
                if exc.errno not in _ACCEPT_TRANSIENT_ERRNOS:  # the listening socket itself is broken
                    log.error("stopped accepting on %s: %s", self._address, exc)
                    return
                failures += 1
                turned = exc.errno in OUT_OF_FDS_ERRNOS and self._turn_away_one(out_of_fds_reason(exc))
                turned_away += turned
                now = time.monotonic()
                if now - logged_at >= ACCEPT_LOG_EVERY_S:
                    log.warning(
                        "accept on %s failed (%d time(s) since the last warning, %d client(s) turned away with the "
                        "reason): %s; still accepting",
                        self._address,
                        failures,
                        turned_away,
                        exc,
                    )
                    failures, turned_away, logged_at = 0, 0, now
                if not turned and exc.errno in _ACCEPT_OUT_OF_RESOURCES:  # (a pause, not a spin, until some free)
                    self._stopped.wait(ACCEPT_RETRY_S)
                continue
            try:
                if conn.family != socket.AF_UNIX:
                    tune_tcp(conn)
                self._accept(StreamConnection(conn, self._address))
            except Exception as exc:  # (a peer reset already, no thread to spare): drop this one, accept the next
                log.warning("dropped a connection on %s: %s", self._address, exc)
                conn.close()

    def _turn_away_one(self, why: str) -> bool:
        """Accept one waiting client on the spare descriptor and tell it ``why`` it cannot be served (its connect
        raises ConnectionLost saying so); whether one was. The spare is taken again after (if another thread took
        the descriptor meanwhile, the loop pauses as it did without one, and tries to take it back next time)."""
        if self._spare_fd is None:
            self._spare_fd = _open_spare()
            return False
        probe = _open_spare()
        if probe is not None:  # descriptors are free again (others let theirs go): the next accept serves the client
            os.close(probe)
            return False
        os.close(self._spare_fd)
        self._spare_fd = None
        try:
            conn, _ = self._sock.accept()
        except OSError:  # gone, or the descriptor went to another thread
            self._spare_fd = _open_spare()
            return False
        try:
            # Its hello first (a client connects, then sends it): refused before it came, the client's send fails
            # (a broken pipe, no reason); left unread, a TCP close resets the connection under the refusal
            waiter = select.poll()
            waiter.register(conn.fileno(), select.POLLIN)
            waiter.poll(TURN_AWAY_HELLO_WAIT_MS)
            conn.setblocking(False)
            for _ in range(_TURNED_AWAY_READ_MAX // 4096):
                if not conn.recv(4096):
                    break
        except OSError:  # (BlockingIOError: all read)
            pass
        try:
            conn.send(encode_frame({"op": "refused", "error": why, "busy": True}))
        except OSError:
            pass
        conn.close()
        self._spare_fd = _open_spare()  # (the client's descriptor, let go just now)
        return True

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._thread.join(timeout=2)
        if self._spare_fd is not None and not self._thread.is_alive():  # (a loop still running may swap it)
            os.close(self._spare_fd)
            self._spare_fd = None
        # (compared while this socket holds its file's inode: another file at the path cannot have its number)
        ours = self._cleanup_path is not None and _is_file(self._cleanup_path, self._cleanup_id)
        self._sock.close()
        if ours:
            _unlink(self._cleanup_path)
        elif self._cleanup_path and os.path.lexists(self._cleanup_path):
            log.info(
                "left %s in place: it is no longer this listener's socket (another took the path)", self._cleanup_path
            )


def _open_spare() -> int | None:
    """A descriptor to hold in reserve (:class:`StreamListener`), or None where none is left."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _unix_path(address: str) -> str:
    """The socket path of a ``unix://`` address; InvalidValue naming the address if no socket can have it."""
    _, path = split_address(address)
    if "\x00" in path:
        raise InvalidValue(f"address: a unix socket path cannot contain a NUL byte: {address!r}")
    if len(os.fsencode(path)) > 107:
        raise InvalidValue(f"address: unix socket path longer than 107 bytes: {path!r}")
    return path


class UnixBackend(Backend):
    def connect(self, address: str, timeout: float) -> StreamConnection:
        path = _unix_path(address)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            _check_peer_user(sock, path)
        except BaseException:
            sock.close()
            raise
        return StreamConnection(sock, address)

    def listen(self, address: str, accept: Handler, *, mode: int = 0o600, **options: Any) -> StreamListener:
        path = _unix_path(address)
        folder = os.path.dirname(os.path.abspath(path))
        # a mode that lets the group or others connect lets them reach the socket in a folder made here too
        folder_mode = 0o700 | (0o010 if mode & 0o060 else 0) | (0o001 if mode & 0o006 else 0)
        created = not os.path.isdir(folder)
        try:
            os.makedirs(folder, mode=folder_mode, exist_ok=True)
        except OSError as exc:
            raise TransportError(f"socket: cannot make the folder of {path}: {exc}") from exc
        owner = os.stat(folder).st_uid
        if owner != os.getuid() and owner != 0:
            # Another user's folder (say a /tmp/kvstrata-<uid> made in advance) could swap our socket.
            raise TransportError(f"cannot listen on {address}: {folder} belongs to uid {owner}, not to us")
        if created and owner == os.getuid():
            os.chmod(folder, folder_mode)  # (makedirs' mode went through the umask)
        _remove_stale_socket(path, address)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            st = os.lstat(path)
            os.chmod(path, mode)  # before listen(): until then a connect is refused, so no window
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot listen on {address}: {exc}") from exc
        _warn_if_unreachable(path, mode)
        return StreamListener(sock, address, accept, cleanup_path=path, cleanup_id=(st.st_dev, st.st_ino))


def _check_peer_user(sock: socket.socket, path: str) -> None:
    """ForeignSocketError unless the process listening at ``path`` runs as this user or root (``SO_PEERCRED``), where
    ``path`` lies in a folder named for this user (``kvstrata-<uid>``, the default socket's when there is no
    ``XDG_RUNTIME_DIR``): a name anyone can predict, and make first. A socket named anywhere else was chosen by
    whoever names it, and may be another user's on purpose (a worker shared with its group, ``--socket-mode
    0660``)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:  # not Linux: the socket's folder (made 0700 by the worker) is all there is
        return
    if os.path.basename(os.path.dirname(os.path.abspath(path))) != f"kvstrata-{os.getuid()}":
        return
    size = struct.calcsize("3i")
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, size))
    if uid in (0, os.getuid(), os.geteuid()):
        return
    raise ForeignSocketError(
        f"refusing the socket {path}: the process listening there (pid {pid}) runs as uid {uid}, not as this user "
        f"(uid {os.getuid()}) or root; it is not this user's kvstrata worker (remove the socket, or point "
        "KVSTRATA_WORKER at the worker's)"
    )


def _warn_if_unreachable(path: str, mode: int) -> None:
    """A socket mode that lets the group or other users connect does nothing while a folder above the socket denies
    them its search (x) permission: say which folders, at start, rather than leave them with a refused connect."""
    who = [label for label, bits in (("its group", 0o060), ("other users", 0o006)) if mode & bits]
    if not who:
        return
    blocked = []
    folder = os.path.dirname(os.path.abspath(path))
    while True:
        try:
            folder_mode = os.stat(folder).st_mode
        except OSError:
            break
        if (mode & 0o006 and not folder_mode & 0o001) or (mode & 0o060 and not folder_mode & 0o011):
            blocked.append(f"{folder} (mode {stat.S_IMODE(folder_mode):04o})")
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    if blocked:
        log.warning(
            "socket mode %04o lets %s connect to %s, but they cannot reach it: %s deny them search (x) permission "
            "(chmod g+x or o+x those folders, or put the socket elsewhere with --socket)",
            mode,
            " and ".join(who),
            path,
            ", ".join(blocked),
        )


def _is_file(path: str, ident: tuple[int, ...] | None) -> bool:
    """Whether ``path`` is the file ``ident`` names (``(st_dev, st_ino[, st_ctime_ns])``; None: any file)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return ident is None or (st.st_dev, st.st_ino, st.st_ctime_ns)[: len(ident)] == ident


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_stale_socket(path: str, address: str) -> None:
    """Unlink the socket file at ``path`` if nothing listens there any more (its worker was killed).

    Only a refused connect proves that: a listener that is alive but busy (its accept backlog full: EAGAIN,
    or slow: a timeout) must keep its socket, so anything else is a TransportError.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise TransportError(f"cannot listen on {address}: {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        # the file probed, not one a worker starting meanwhile put in its place (nothing holds a stale socket's inode,
        # so the new file may have its number: its change time tells them apart)
        if _is_file(path, (st.st_dev, st.st_ino, st.st_ctime_ns)):
            _unlink(path)
            log.info("removed stale socket %s (its worker is gone)", path)
        return
    except OSError as exc:
        raise TransportError(
            f"cannot listen on {address}: a worker seems to be listening there, busy (a connect to it failed: "
            f"{exc}); stop it or choose another path"
        ) from exc
    finally:
        probe.close()
    raise TransportError(f"cannot listen on {address}: another worker is already listening there")


def _host_port(address: str, *, listening: bool) -> tuple[str, int]:
    """``tcp://host:port`` -> ``(host, port)``; InvalidValue naming the address if it is not one.

    Port 0 (any free port) is for listening only.
    """
    _, location = split_address(address)
    host, sep, port_text = location.rstrip("/").rpartition(":")
    if not sep or not port_text.isdigit():
        raise InvalidValue(f"address: expected tcp://host:port, got {address!r}")
    port = int(port_text)
    if not (0 if listening else 1) <= port <= 65535:
        allowed = "0-65535" if listening else "1-65535"
        raise InvalidValue(f"address: port {port} is not in {allowed} in {address!r}")
    return host.strip("[]") or "127.0.0.1", port


class TcpBackend(Backend):
    def connect(self, address: str, timeout: float) -> StreamConnection:
        sock = socket.create_connection(_host_port(address, listening=False), timeout=timeout)
        try:
            tune_tcp(sock)
        except BaseException:
            sock.close()
            raise
        return StreamConnection(sock, address)

    def listen(self, address: str, accept: Handler, **options: Any) -> StreamListener:
        host, port = _host_port(address, listening=True)
        try:
            sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        except OSError as exc:
            raise TransportError(f"cannot listen on {address}: {exc}") from exc
        real = sock.getsockname()
        shown = f"[{real[0]}]" if ":" in real[0] else real[0]
        return StreamListener(sock, f"tcp://{shown}:{real[1]}", accept)


register_backend("unix", UnixBackend())
register_backend("tcp", TcpBackend())
