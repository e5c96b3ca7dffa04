"""Descriptor numbers and descriptor limits: a worker or client whose descriptors are numbered 1024 or more (select's
FD_SETSIZE: the transport waited with select, which refuses them, so nothing connected), and a worker out of
descriptors (clients it could not take were dropped with no reason, and it logged a traceback for each).

The workers run in subprocesses: a process that opens a thousand descriptors, or runs out of them, must not be
the one running pytest.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import kvstrata
from kvstrata.errors import ConnectionLost, Timeout
from kvstrata.transport.stream import StreamConnection

SRC = str(Path(__file__).resolve().parents[1] / "src")
HIGH_FDS = 1100  # descriptors opened to push new ones past select's 1024

# A worker in its own process, with HIGH_FDS descriptors open first where argv[2] says so. It prints its address,
# then reads commands: "fill N" opens /dev/null until only N descriptors are left (prints how many it opened),
# "settle" waits until a descriptor can be opened (a client just turned away may still hold one: the worker
# closes its socket after the client has read the refusal), "free" closes them, "cpu" prints its CPU seconds.
WORKER = textwrap.dedent(
    """
    import logging, os, sys, time
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(int(sys.argv[2]))]
    from kvstrata.server.config import WorkerConfig
    from kvstrata.server.worker import Worker
    worker = Worker(WorkerConfig(socket=sys.argv[1], memory=16 << 20, disk_dir="")).start()
    print(worker.address, flush=True)
    filler = []
    for line in sys.stdin:
        command = line.split()
        if command[0] == "fill":
            filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(64)]
            try:
                while True:
                    filler.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass
            for _ in range(int(command[1])):
                os.close(filler.pop())
            print(len(filler), flush=True)
        elif command[0] == "settle":
            for _ in range(500):
                try:
                    os.close(os.open(os.devnull, os.O_RDONLY))
                    break
                except OSError:
                    time.sleep(0.01)
            print("settled", flush=True)
        elif command[0] == "free":
            for fd in filler:
                os.close(fd)
            filler = []
            print("freed", flush=True)
        elif command[0] == "cpu":
            t = os.times()
            print(t.user + t.system, flush=True)
    worker.stop()
    """
)


class WorkerProcess:
    """A worker subprocess running :data:`WORKER`; ``nofile``: its RLIMIT_NOFILE (soft and hard), if given."""

    def __init__(self, tmp_path: Path, *, high_fds: int = 0, nofile: int | None = None) -> None:
        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.stderr_path = tmp_path / "worker.err"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(tmp_path / "kv.sock"), str(high_fds)],
            env=dict(os.environ, PYTHONPATH=SRC),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr_path.open("w"),
            text=True,
            preexec_fn=limit,
        )
        self.address = self.ask(None)

    def ask(self, command: str | None) -> str:
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the worker exited: {self.stderr_path.read_text()}"
        return line.strip()

    def log(self) -> str:
        return self.stderr_path.read_text()

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture
def high_fd_room():
    """This process's soft RLIMIT_NOFILE raised to hold HIGH_FDS more descriptors (restored after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the hard descriptor limit ({hard}) leaves no room for descriptors numbered past 1024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_stream_waits_on_descriptors_past_1024(high_fd_room):
    """The timed waits (a frame's first bytes, a large frame's rest) work on a socket numbered past 1024."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    high_a, high_b = os.dup2(a.fileno(), 1500), os.dup2(b.fileno(), 1501)
    a.close()
    b.close()
    sender = StreamConnection(socket.socket(fileno=high_a), "unix://high")
    receiver = StreamConnection(socket.socket(fileno=high_b), "unix://high")
    try:
        assert receiver.fileno() >= 1024
        sender.send({"small": 1})
        assert receiver.recv(timeout=5)[0] == {"small": 1}
        big = b"x" * (3 << 20)  # a large frame: its rest is read by _read_into, with a deadline
        sending = threading.Thread(target=sender.send, args=({"big": big},))  # (more than the socket holds)
        sending.start()
        assert receiver.recv(timeout=5)[0] == {"big": big}
        sending.join()
    finally:
        sender.close()
        receiver.close()


def test_client_with_descriptors_past_1024_connects(tmp_path, high_fd_room):
    """A client process with many files open (data loaders) connects, sets and gets (its socket past 1024)."""
    worker = WorkerProcess(tmp_path)
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(HIGH_FDS)]
    try:
        assert max(held) >= 1024
        with kvstrata.connect(address=worker.address, timeout=10) as kv:
            kv.set("small", b"s" * 100)
            kv.set("large", b"L" * (2 << 20))  # through shared memory
            assert kv.get("small") == b"s" * 100
            assert kv.get("large") == b"L" * (2 << 20)
    finally:
        for fd in held:
            os.close(fd)
        worker.stop()


def test_worker_with_descriptors_past_1024_accepts(tmp_path, high_fd_room):
    """A worker whose new descriptors are numbered past 1024 (a thousand clients, or files) still serves clients."""
    worker = WorkerProcess(tmp_path, high_fds=HIGH_FDS)  # (its limit: this process's, raised by high_fd_room)
    try:
        for round_ in range(3):
            with kvstrata.connect(address=worker.address, timeout=10) as kv:
                kv.set(f"k{round_}", b"v" * 4096)
                assert kv.get(f"k{round_}") == b"v" * 4096
        assert "Traceback" not in worker.log()
    finally:
        worker.stop()


def test_worker_out_of_descriptors_turns_clients_away_with_the_reason(tmp_path):
    """Past its descriptor limit a worker tells each new client why (its connect raises ConnectionLost saying so),
    logs a warning rather than a traceback a client, serves the clients it has, and takes new ones once
    descriptors are free again."""
    worker = WorkerProcess(tmp_path, nofile=128)
    try:
        first = kvstrata.connect(address=worker.address, timeout=10)
        first.set("kept", b"k" * 4096)
        # Room to accept a client but not to make its shared-memory lane: turned away by the handshake
        worker.ask("fill 1")
        for _ in range(3):
            worker.ask("settle")  # (else the last refused client's socket, not yet closed, takes that descriptor)
            with pytest.raises(
                ConnectionLost, match=r"out of file descriptors \(EMFILE\): 1 clients connected.*ulimit"
            ):
                kvstrata.connect(address=worker.address, timeout=5)
        assert first.get("kept") == b"k" * 4096
        worker.ask("free")
        # No room even to accept: turned away by the accept loop, on the descriptor it keeps for that
        worker.ask("fill 0")
        for _ in range(3):
            with pytest.raises(ConnectionLost, match=r"out of file descriptors \(EMFILE\).*ulimit -n"):
                kvstrata.connect(address=worker.address, timeout=5)
        cpu_before = float(worker.ask("cpu"))
        time.sleep(1.0)
        assert float(worker.ask("cpu")) - cpu_before < 0.3, "the accept loop spins while out of descriptors"
        assert first.get("kept") == b"k" * 4096
        worker.ask("free")
        with kvstrata.connect(address=worker.address, timeout=10) as kv:
            assert kv.get("kept") == b"k" * 4096
        first.close()
        log = worker.log()
        assert "Traceback" not in log, log
        assert log.count("WARNING") <= 2, log  # one line for a burst of refusals, not one a client
        assert "turned away" in log
    finally:
        worker.stop()


def test_a_device_object_waiter_waits_on_descriptors_past_1024(high_fd_room):
    """The device-object client's waits (kvstrata.devobj.lead.PollRole) watched their connection with select too."""
    from kvstrata.devobj.lead import PollRole

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    high_a, high_b = os.dup2(a.fileno(), 1510), os.dup2(b.fileno(), 1511)
    a.close()
    b.close()
    role = PollRole(high_b)
    try:
        assert not role.wait_readable(0.01) and not role.wait_readable(0.01, spin=0.005)  # nothing there: times out
        os.write(high_a, b"x")
        assert role.wait_readable(5) and role.wait_readable(5, spin=0.001)
    finally:
        role.close()
        role.release()
        os.close(high_a)
        os.close(high_b)


def test_a_timeout_message_shows_its_seconds_to_three_digits():
    """Session 38's audit saw "no message from ... within 4.999757560999569 s"."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    receiver = StreamConnection(b, "unix://short")
    try:
        with pytest.raises(Timeout, match=r"within 0\.0123 s$"):
            receiver.recv(timeout=0.012345678)
    finally:
        receiver.close()
        a.close()
