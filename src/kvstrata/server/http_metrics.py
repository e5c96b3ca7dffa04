"""The worker's Prometheus endpoint: ``GET /metrics`` over HTTP, for a scraper (``--metrics-address``).

Served by the standard library's threading HTTP server on a thread of its own, apart from the clients'
socket; a scrape takes the worker's stats the way ``kvstrata status`` does. ``/`` answers with a line
saying where the metrics are; anything else is a 404.

Each connection has a thread and a descriptor of the worker's, so a client that connects and sends nothing (or
half a request) must not keep them: a connection that sends or takes nothing for :data:`REQUEST_TIMEOUT_S` is
closed, and one beyond :data:`MAX_CONNECTIONS` open at once is closed unanswered (idle connections had used up the
worker's descriptors, and with them its clients' connections). A client that hangs up mid-reply is a debug line.

>>> server = MetricsServer(lambda: {"objects": 3}, "127.0.0.1", 0)
>>> import urllib.request
>>> "kvstrata_objects 3" in urllib.request.urlopen(server.url).read().decode()
True
>>> server.stop()
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvstrata.server.metrics import to_prometheus

log = logging.getLogger(__name__)

#: the Prometheus text exposition format's content type
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: seconds a connection may send or take nothing (reading its request, writing the reply) before it is closed
REQUEST_TIMEOUT_S = 5.0
#: metrics connections served at once (a thread each); more are closed as they come
MAX_CONNECTIONS = 16
#: connections waiting in the kernel to be accepted (socketserver's default of 5 refuses a burst of scrapers)
LISTEN_BACKLOG = 128
#: seconds between warnings that connections were refused for being over MAX_CONNECTIONS
_REFUSED_WARNING_INTERVAL_S = 60.0
#: a client that went away: nothing the worker can fix or should print a traceback for
_CLIENT_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a slow scraper never holds the worker's shutdown
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address: tuple[str, int], handler: type[_Handler], max_connections: int) -> None:
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)  # one per connection being served
        self._refused = 0  # since the last warning
        self._refused_warned_at = -_REFUSED_WARNING_INTERVAL_S
        super().__init__(address, handler)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Take a slot for the connection's thread; none free: socketserver closes the connection."""
        if self._slots.acquire(blocking=False):
            return True
        self._refused += 1
        now = time.monotonic()
        if now - self._refused_warned_at >= _REFUSED_WARNING_INTERVAL_S:
            log.warning(
                "metrics: closed %d connection(s) unanswered: %d are open already (the most served at once)",
                self._refused,
                self.max_connections,
            )
            self._refused, self._refused_warned_at = 0, now
        else:
            log.debug("metrics: closed a connection from %s: %d are open", client_address, self.max_connections)
        return False

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started (socketserver closes the connection): its slot is free
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Called by socketserver in an ``except`` block for a connection whose handling failed."""
        exc = sys.exc_info()[1]
        if isinstance(exc, _CLIENT_GONE):
            log.debug("metrics: client %s went away: %s", client_address, exc)
        else:
            log.warning("metrics: serving %s failed", client_address, exc_info=True)


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6  # an IPv6 host, such as ::1 (from "[::1]:9464")


class MetricsServer:
    """Serves ``to_prometheus(stats())`` at ``http://host:port/metrics`` until :meth:`stop`; ``host`` may be IPv6.

    A connection idle for ``timeout`` seconds is closed, and at most ``max_connections`` are served at once.
    """

    def __init__(
        self,
        stats: Callable[[], dict[str, Any]],
        host: str,
        port: int,
        *,
        timeout: float = REQUEST_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        handler = type("MetricsHandler", (_Handler,), {"stats": staticmethod(stats), "timeout": timeout})
        server = _HTTPServer6 if ":" in host else _HTTPServer
        self._httpd = server((host, port), handler, max_connections)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvstrata-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        host = f"[{host}]" if ":" in str(host) else host
        return f"http://{host}:{port}/metrics"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    stats: Callable[[], dict[str, Any]]
    server_version = "kvstrata-worker"
    # the connection's socket timeout: a request's read or a reply's write stalled this long ends the connection
    timeout = REQUEST_TIMEOUT_S

    def do_GET(self) -> None:  # the name http.server calls
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            try:
                body, status = to_prometheus(self.stats()).encode(), 200
            except Exception as exc:  # the worker is shutting down, or a stat failed: say so, keep serving
                log.warning("metrics scrape failed: %s", exc)
                body, status = f"kvstrata worker: stats unavailable: {exc}\n".encode(), 503
        elif path == "/":
            body, status = b"kvstrata worker: Prometheus metrics at /metrics\n", 200
        else:
            body, status = b"not found: the metrics are at /metrics\n", 404
        self.send_response(status)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # http.server calls it by this signature
        log.debug("metrics %s: " + format, self.client_address[0], *args)
