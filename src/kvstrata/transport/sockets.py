"""``unix://`` and ``tcp://`` backends: stream sockets carrying :mod:`kvstrata.transport.stream` frames.

``unix:///path.sock`` is the node-local transport: it can pass file descriptors (the shared memory
segments) and its socket file is created with mode 0600, so only the worker's user can connect.
A stale socket file left by a killed worker is replaced; a live one is an error.
``tcp://host:port`` is for the cluster mode; it cannot pass descriptors.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
from typing import Any

from kvstrata.errors import InvalidValue, TransportError
from kvstrata.transport.base import Backend, Handler, Listener, register_backend, split_address
from kvstrata.transport.stream import StreamConnection

log = logging.getLogger(__name__)


class StreamListener(Listener):
    """Accept loop on a listening socket, in a daemon thread."""

    def __init__(self, sock: socket.socket, address: str, accept: Handler, cleanup_path: str | None = None) -> None:
        self._sock = sock
        self._address = address
        self._accept = accept
        self._cleanup_path = cleanup_path
        self._stopped = threading.Event()
        # A timeout lets the loop notice stop(): closing a socket does not wake accept() on Linux.
        sock.settimeout(0.2)
        self._thread = threading.Thread(target=self._run, name=f"kvstrata-accept {address}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return self._address

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if not self._stopped.is_set():
                    log.error("stopped accepting on %s: %s", self._address, exc)
                return
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._accept(StreamConnection(conn, self._address))

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._thread.join(timeout=2)
        self._sock.close()
        if self._cleanup_path:
            try:
                os.unlink(self._cleanup_path)
            except FileNotFoundError:
                pass


class UnixBackend(Backend):
    def connect(self, address: str, timeout: float) -> StreamConnection:
        _, path = split_address(address)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        return StreamConnection(sock, address)

    def listen(self, address: str, accept: Handler, *, mode: int = 0o600, **options: Any) -> StreamListener:
        _, path = split_address(address)
        if len(os.fsencode(path)) > 107:
            raise InvalidValue(f"address: unix socket path longer than 107 bytes: {path!r}")
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise TransportError(f"socket: cannot make the folder of {path}: {exc}") from exc
        owner = os.stat(folder).st_uid
        if owner != os.getuid() and owner != 0:
            # Another user's folder (say a /tmp/kvstrata-<uid> made in advance) could swap our socket.
            raise TransportError(f"cannot listen on {address}: {folder} belongs to uid {owner}, not to us")
        _remove_stale_socket(path, address)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, mode)  # before listen(): until then a connect is refused, so no window
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot listen on {address}: {exc}") from exc
        return StreamListener(sock, address, accept, cleanup_path=path)


def _remove_stale_socket(path: str, address: str) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise TransportError(f"cannot listen on {address}: {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError:
        log.info("removing stale socket %s (its worker is gone)", path)
        os.unlink(path)
        return
    finally:
        probe.close()
    raise TransportError(f"cannot listen on {address}: another worker is already listening there")


def _host_port(address: str) -> tuple[str, int]:
    _, location = split_address(address)
    host, sep, port = location.rstrip("/").rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidValue(f"address: expected tcp://host:port, got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


class TcpBackend(Backend):
    def connect(self, address: str, timeout: float) -> StreamConnection:
        sock = socket.create_connection(_host_port(address), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return StreamConnection(sock, address)

    def listen(self, address: str, accept: Handler, **options: Any) -> StreamListener:
        host, port = _host_port(address)
        try:
            sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        except OSError as exc:
            raise TransportError(f"cannot listen on {address}: {exc}") from exc
        real = sock.getsockname()
        shown = f"[{real[0]}]" if ":" in real[0] else real[0]
        return StreamListener(sock, f"tcp://{shown}:{real[1]}", accept)


register_backend("unix", UnixBackend())
register_backend("tcp", TcpBackend())
