"""Unix sockets and other users and other listeners: whose socket a listener removes, whose a client talks to, and
who can reach a socket whose mode lets them. (Items 2, 3 and 8 of the audit of `kvstrata worker`.)"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import struct
import subprocess
import tempfile
import time

import pytest

from kvstrata.errors import TransportError
from kvstrata.transport import connect, listen, sockets


def _serve(conn) -> None:
    try:
        while True:
            msg, _ = conn.recv()
            conn.send(msg)
    except Exception:
        conn.close()


def _inode(path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_dev, st.st_ino


# 2. a listener removes only its own socket file -----------------------------------------------------------------------
def test_stop_leaves_another_listeners_socket_alone(tmp_path):
    """Item 2: stop() unlinked whatever was at its path, even the live socket of a worker started since."""
    path = tmp_path / "c.sock"
    first = listen(f"unix://{path}", _serve)
    path.unlink()  # a tmpfiles cleanup, or an operator "fixing" things
    second = listen(f"unix://{path}", _serve)
    theirs = _inode(path)
    first.stop()
    assert path.exists() and _inode(path) == theirs
    with connect(f"unix://{path}", timeout=2) as conn:
        conn.send({"x": 1})
        assert conn.recv(timeout=2)[0] == {"x": 1}
    second.stop()
    assert not path.exists()  # its own it removes


def test_the_stale_socket_removal_takes_only_the_file_it_probed(tmp_path, monkeypatch):
    """Item 2: between its probe (refused: stale) and its unlink, a worker starting meanwhile may have put its socket
    there: that one stays."""
    path = tmp_path / "s.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # a killed worker's file: nothing listens there
    live = []

    class Racing(socket.socket):
        def connect(self, address):
            try:
                super().connect(address)
            except ConnectionRefusedError:  # the probe: another worker takes the path right now
                os.unlink(path)
                live.append(listen(f"unix://{path}", _serve))
                raise

    monkeypatch.setattr(sockets.socket, "socket", Racing)
    sockets._remove_stale_socket(str(path), f"unix://{path}")  # its probe was refused: stale, it thinks
    monkeypatch.undo()
    try:
        assert path.exists()
        with connect(f"unix://{path}", timeout=2) as conn:
            conn.send({"y": 2})
            assert conn.recv(timeout=2)[0] == {"y": 2}
    finally:
        for lst in live:
            lst.stop()


# 3. a client talks only to its own user's (or root's) listener ------------------------------------------------------
class _OtherUsersPeer(socket.socket):
    """A socket whose peer credentials say uid 4242 (what SO_PEERCRED gives for another user's listener)."""

    def getsockopt(self, level, option, *args):
        if level == socket.SOL_SOCKET and option == getattr(socket, "SO_PEERCRED", None):
            return struct.pack("3i", 31337, 4242, 4242)
        return super().getsockopt(level, option, *args)


@pytest.mark.skipif(not hasattr(socket, "SO_PEERCRED"), reason="SO_PEERCRED is Linux's")
def test_a_client_refuses_a_listener_of_another_user(tmp_path, monkeypatch):
    """Item 3: a client connected to a socket another user listened on (a squatted /tmp/kvstrata-<uid>/), and sent
    it its requests and data."""
    if os.getuid() == 4242:
        pytest.skip("the fake peer's uid is ours")
    tmp_path = tmp_path / f"kvstrata-{os.getuid()}"  # the default socket's folder, when there is no XDG_RUNTIME_DIR
    lst = listen(f"unix://{tmp_path}/s.sock", _serve)
    try:
        with connect(lst.address, timeout=2):
            pass  # our own listener
        monkeypatch.setattr(socket, "socket", _OtherUsersPeer)
        t0 = time.monotonic()
        with pytest.raises(TransportError) as caught:
            connect(lst.address, timeout=5)
        assert time.monotonic() - t0 < 1  # refused, not retried
    finally:
        monkeypatch.undo()
        lst.stop()
    exc = caught.value
    refusal = exc if isinstance(exc, sockets.ForeignSocketError) else exc.__cause__
    assert isinstance(refusal, sockets.ForeignSocketError) and isinstance(refusal, PermissionError)
    assert f"{tmp_path}/s.sock" in str(exc) and "uid 4242" in str(exc) and "pid 31337" in str(exc)


@pytest.mark.skipif(not hasattr(socket, "SO_PEERCRED"), reason="SO_PEERCRED is Linux's")
def test_a_socket_named_elsewhere_may_be_another_users(tmp_path, monkeypatch):
    """A socket the caller names outside a folder named for its user may be another user's on purpose (a worker
    shared with its group, ``--socket-mode 0660``): connected to."""
    lst = listen(f"unix://{tmp_path}/shared.sock", _serve)
    try:
        monkeypatch.setattr(socket, "socket", _OtherUsersPeer)
        with connect(lst.address, timeout=2):
            pass
    finally:
        monkeypatch.undo()
        lst.stop()


@pytest.mark.skipif(os.getuid() != 0 or not hasattr(socket, "SO_PEERCRED"), reason="needs root to be another user")
@pytest.mark.skipif(not os.access("/usr/bin/python3", os.X_OK), reason="no system Python for another user to run")
def test_a_client_refuses_a_real_listener_of_another_user():
    """Item 3, with a real other user: root's client and a listener running as uid 65534 (nobody)."""
    top = tempfile.mkdtemp(prefix="kvstrata-squat-", dir="/tmp")  # (pytest's folders are root's alone)
    os.chmod(top, 0o755)
    folder = os.path.join(top, f"kvstrata-{os.getuid()}")  # as a squatter makes /tmp/kvstrata-<uid> first
    os.mkdir(folder)
    os.chmod(folder, 0o777)
    path = os.path.join(folder, "squat.sock")
    code = (
        "import os, socket, sys, time\n"
        "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); os.chmod(sys.argv[1], 0o666); s.listen()\n"
        "print('ready', flush=True)\n"
        "s.settimeout(20)\n"
        "try:\n    c, _ = s.accept(); time.sleep(1)\nexcept OSError:\n    pass\n"
    )
    squatter = subprocess.Popen(
        ["/usr/bin/python3", "-c", code, path], user=65534, group=65534, cwd="/", stdout=subprocess.PIPE, text=True
    )
    try:
        assert squatter.stdout.readline().strip() == "ready"
        with pytest.raises(TransportError, match="runs as uid 65534"):
            connect(f"unix://{path}", timeout=5)
    finally:
        squatter.kill()
        squatter.wait()
        shutil.rmtree(top, ignore_errors=True)


# 8. a socket mode for the group or others, and the folders above the socket ---------------------------------------
@pytest.mark.parametrize("mode, folder_mode", [(0o600, 0o700), (0o660, 0o710), (0o666, 0o711), (0o606, 0o701)])
def test_the_folder_made_for_a_shared_socket_lets_them_through(tmp_path, mode, folder_mode):
    """Item 8: --socket-mode 0666 did nothing on the default path: the folder kvstrata made for it was 0700."""
    folder = tmp_path / "made-here"
    old = os.umask(0o077)  # (the mode must not depend on the umask)
    try:
        lst = listen(f"unix://{folder}/w.sock", _serve, mode=mode)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(folder).st_mode) == folder_mode
        assert stat.S_IMODE(os.stat(folder / "w.sock").st_mode) == mode
    finally:
        lst.stop()


def test_a_folder_that_keeps_them_out_is_warned_about(tmp_path, caplog):
    """Item 8: a folder already there (made 0700 by an earlier run, say) kept them out without a word."""
    folder = tmp_path / "private"
    folder.mkdir(mode=0o700)
    os.chmod(folder, 0o700)
    with caplog.at_level(logging.WARNING, logger="kvstrata"):
        lst = listen(f"unix://{folder}/w.sock", _serve, mode=0o666)
        lst.stop()
    said = [r.getMessage() for r in caplog.records if "cannot reach it" in r.getMessage()]
    assert len(said) == 1 and f"{folder} (mode 0700)" in said[0] and "other users" in said[0]
    caplog.clear()
    os.chmod(folder, 0o755)
    os.chmod(tmp_path, 0o755)
    with caplog.at_level(logging.WARNING, logger="kvstrata"):
        lst = listen(f"unix://{folder}/w.sock", _serve, mode=0o600)  # for its owner only: nothing to say
        lst.stop()
    assert not [r for r in caplog.records if "cannot reach it" in r.getMessage()]
