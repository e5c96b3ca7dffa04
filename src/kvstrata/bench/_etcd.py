"""A throwaway etcd server for benchmarks and tests: the ``etcd`` binary (Debian's ``etcd-server``) on free
loopback ports, its data in a temporary folder, stopped on exit; over HTTPS with ``tls=`` (its client port only:
the peer port of a one-member etcd is never dialled)."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalEtcd:
    """``with LocalEtcd() as etcd: etcd.endpoint`` (``127.0.0.1:PORT``): a one-member etcd, healthy on entry.

    ``folder``: where its data and log go (default: a temporary folder, removed on exit). ``tls``:
    ``(ca_path, cert_path, key_path)``: serve clients over HTTPS with that certificate (signed by that CA, for
    127.0.0.1), and with ``client_cert_auth`` (the default) take only clients with a certificate the CA signed;
    etcd's own gateway, and the health check here, then present the server's certificate as theirs, so it needs
    the clientAuth usage too. ``args``: more flags for etcd (``--auth-token-ttl``, say). FileNotFoundError when
    there is no ``etcd`` binary; RuntimeError, with its log's end, when it exits or is not healthy in ``wait_s``.
    """

    def __init__(
        self,
        folder: str | Path | None = None,
        *,
        wait_s: float = 30.0,
        tls: tuple[str | Path, str | Path, str | Path] | None = None,
        client_cert_auth: bool = True,
        args: Sequence[str] = (),
    ) -> None:
        self._given = folder
        self._wait_s = wait_s
        self._tls = None if tls is None else tuple(str(Path(f).resolve()) for f in tls)
        self._client_cert_auth = client_cert_auth
        self._args = list(args)
        self.proc: subprocess.Popen | None = None
        self.endpoint = ""
        #: ``http`` or ``https``: how clients reach it (``etcd://`` or ``etcds://`` addresses)
        self.scheme = "https" if tls is not None else "http"

    def __enter__(self) -> LocalEtcd:
        binary = shutil.which("etcd")
        if binary is None:
            raise FileNotFoundError("no etcd binary on PATH (Debian/Ubuntu: apt-get install etcd-server)")
        self._tmp = None if self._given else tempfile.TemporaryDirectory(prefix="kvstrata-etcd-")
        folder = Path(self._given or self._tmp.name)
        folder.mkdir(parents=True, exist_ok=True)
        self.log_path = folder / "etcd.log"
        client_url = f"{self.scheme}://127.0.0.1:{_free_port()}"
        peer_url = f"http://127.0.0.1:{_free_port()}"
        tls_flags = []
        if self._tls is not None:
            ca, cert, key = self._tls
            tls_flags = ["--cert-file", cert, "--key-file", key]
            if self._client_cert_auth:  # (etcd asks every client for a certificate once it has a CA to check them)
                tls_flags += ["--trusted-ca-file", ca, "--client-cert-auth"]
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    "--name", "kvstrata",
                    "--data-dir", str(folder / "data"),
                    "--listen-client-urls", client_url,
                    "--advertise-client-urls", client_url,
                    "--listen-peer-urls", peer_url,
                    "--initial-advertise-peer-urls", peer_url,
                    "--initial-cluster", f"kvstrata={peer_url}",
                    *tls_flags,
                    *self._args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.endpoint = client_url.partition("://")[2]
        try:
            self._wait_healthy()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_healthy(self) -> None:
        """Until etcd answers: over HTTP, ``GET /health``; over HTTPS, a call through its v3 gateway (which, unlike
        /health, fails while the gateway cannot reach etcd with the server's certificate)."""
        deadline = time.monotonic() + self._wait_s
        context = None
        if self._tls is not None:
            ca, cert, key = self._tls
            context = ssl.create_default_context(cafile=ca)
            context.load_cert_chain(cert, key)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd at {self.endpoint} exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if context is None:
                    request = urllib.request.Request(f"http://{self.endpoint}/health")
                else:
                    request = urllib.request.Request(
                        f"https://{self.endpoint}/v3/maintenance/status", data=b"{}", method="POST"
                    )
                with urllib.request.urlopen(request, timeout=1, context=context) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"etcd at {self.endpoint} not healthy within {self._wait_s:g} s: {self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text()[-2000:]
        except OSError:
            return "(no log)"

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
