"""A throwaway etcd server for benchmarks and tests: the ``etcd`` binary (Debian's ``etcd-server``) on free
loopback ports, its data in a temporary folder, stopped on exit."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalEtcd:
    """``with LocalEtcd() as etcd: etcd.endpoint`` (``127.0.0.1:PORT``): a one-member etcd, healthy on entry.

    ``folder``: where its data and log go (default: a temporary folder, removed on exit). FileNotFoundError when
    there is no ``etcd`` binary; RuntimeError, with its log's end, when it exits or is not healthy in ``wait_s``.
    """

    def __init__(self, folder: str | Path | None = None, *, wait_s: float = 30.0) -> None:
        self._given = folder
        self._wait_s = wait_s
        self.proc: subprocess.Popen | None = None
        self.endpoint = ""

    def __enter__(self) -> LocalEtcd:
        binary = shutil.which("etcd")
        if binary is None:
            raise FileNotFoundError("no etcd binary on PATH (Debian/Ubuntu: apt-get install etcd-server)")
        self._tmp = None if self._given else tempfile.TemporaryDirectory(prefix="kvstrata-etcd-")
        folder = Path(self._given or self._tmp.name)
        folder.mkdir(parents=True, exist_ok=True)
        self.log_path = folder / "etcd.log"
        client_url, peer_url = f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
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
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.endpoint = client_url.removeprefix("http://")
        try:
            self._wait_healthy()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self._wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as reply:
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
