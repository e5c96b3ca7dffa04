"""The worker's Prometheus endpoint: ``GET /metrics`` over HTTP, for a scraper (``--metrics-address``).

Served by the standard library's threading HTTP server on a thread of its own, apart from the clients'
socket; a scrape takes the worker's stats the way ``kvstrata status`` does. ``/`` answers with a line
saying where the metrics are; anything else is a 404.

>>> server = MetricsServer(lambda: {"objects": 3}, "127.0.0.1", 0)
>>> import urllib.request
>>> "kvstrata_objects 3" in urllib.request.urlopen(server.url).read().decode()
True
>>> server.stop()
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvstrata.server.metrics import to_prometheus

log = logging.getLogger(__name__)

#: the Prometheus text exposition format's content type
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a slow scraper never holds the worker's shutdown


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6  # an IPv6 host, such as ::1 (from "[::1]:9464")


class MetricsServer:
    """Serves ``to_prometheus(stats())`` at ``http://host:port/metrics`` until :meth:`stop`; ``host`` may be IPv6."""

    def __init__(self, stats: Callable[[], dict[str, Any]], host: str, port: int) -> None:
        handler = type("MetricsHandler", (_Handler,), {"stats": staticmethod(stats)})
        server = _HTTPServer6 if ":" in host else _HTTPServer
        self._httpd = server((host, port), handler)
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
