"""A listener given a token serves only clients that prove they hold it (a challenge: HMAC-SHA256 of a fresh nonce,
the token never sent): the right token connects, a wrong one or none is refused with AuthenticationError naming what
to do, ``$KVSTRATA_TOKEN`` is the client's default, and a worker's TCP listeners take theirs from
``--auth-token-file`` or ``$KVSTRATA_TOKEN`` (its Unix socket asks for none)."""

from __future__ import annotations

import pytest

import kvstrata
from kvstrata.errors import AuthenticationError, InvalidValue
from kvstrata.server import Worker, WorkerConfig
from kvstrata.transport import connect, listen
from kvstrata.transport.core import TOKEN_ENV
from test_transport import echo


@pytest.fixture
def guarded():
    listener = listen("tcp://127.0.0.1:0", echo, token="s3cret-token-of-the-cluster")
    yield listener.address
    listener.stop()


def test_the_right_token_connects_and_the_token_never_crosses_the_wire(guarded, monkeypatch):
    from kvstrata.transport.stream import StreamConnection

    sent = []
    original = StreamConnection.send

    def spy(self, msg, *args, **kwargs):
        sent.append(repr(msg))
        return original(self, msg, *args, **kwargs)

    monkeypatch.setattr(StreamConnection, "send", spy)
    with connect(guarded, timeout=5, token="s3cret-token-of-the-cluster") as conn:
        conn.send({"x": 1})
        assert conn.recv()[0] == {"x": 1}
    assert any("'op': 'auth'" in m for m in sent) and any("'op': 'challenge'" in m for m in sent)
    assert not any("s3cret" in m for m in sent)


@pytest.mark.parametrize("token", ["another-token", b"s3cret-token-of-the-cluster!"])
def test_a_wrong_token_is_refused(guarded, token):
    with pytest.raises(AuthenticationError, match="refused the token"):
        connect(guarded, timeout=5, token=token)


def test_no_token_is_refused_naming_the_variable(guarded, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(AuthenticationError, match=TOKEN_ENV):
        connect(guarded, timeout=5)


def test_the_token_comes_from_the_environment_by_default(guarded, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "s3cret-token-of-the-cluster\n")
    with connect(guarded, timeout=5) as conn:
        conn.send({"y": 2})
        assert conn.recv()[0] == {"y": 2}


def test_a_listener_with_no_token_ignores_a_clients(monkeypatch):
    listener = listen("tcp://127.0.0.1:0", echo)
    try:
        with connect(listener.address, timeout=5, token="whatever") as conn:
            conn.send({"z": 3})
            assert conn.recv()[0] == {"z": 3}
    finally:
        listener.stop()


def test_a_bad_token_type_is_named():
    with pytest.raises(InvalidValue, match="token"):
        listen("tcp://127.0.0.1:0", echo, token=123)


def test_a_refused_client_costs_the_listener_nothing(guarded):
    for _ in range(20):
        with pytest.raises(AuthenticationError):
            connect(guarded, timeout=5, token="wrong")
    with connect(guarded, timeout=5, token="s3cret-token-of-the-cluster") as conn:
        conn.send({"still": "serving"})
        assert conn.recv()[0] == {"still": "serving"}


# a worker ---------------------------------------------------------------------------------------------------------
def test_a_worker_with_a_token_file_serves_tcp_clients_holding_it(tmp_path, monkeypatch):
    secret = tmp_path / "token"
    secret.write_text("worker-token-0123456789\n")
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    worker = Worker(
        WorkerConfig(socket="tcp://127.0.0.1:0", memory=16 << 20, disk_dir="", auth_token_file=str(secret))
    ).start()
    try:
        with pytest.raises(AuthenticationError):
            kvstrata.connect(address=worker.address, timeout=5)
        monkeypatch.setenv(TOKEN_ENV, "worker-token-0123456789")
        with kvstrata.connect(address=worker.address, timeout=5) as kv:
            kv.set("k", b"v")
            assert kv.get("k") == b"v"
    finally:
        worker.stop()


def test_a_workers_unix_socket_asks_for_no_token(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "from-the-environment-token")
    worker = Worker(WorkerConfig(socket=str(tmp_path / "w.sock"), memory=16 << 20, disk_dir="")).start()
    try:
        monkeypatch.delenv(TOKEN_ENV)
        with kvstrata.connect(address=worker.address, timeout=5) as kv:
            kv.set("k", b"v")
    finally:
        worker.stop()


def test_a_token_file_missing_or_empty_is_named(tmp_path):
    with pytest.raises(InvalidValue, match=r"auth_token_file \(--auth-token-file\): cannot read"):
        WorkerConfig(auth_token_file=str(tmp_path / "nope"))
    (tmp_path / "empty").write_text(" \n")
    with pytest.raises(InvalidValue, match="is empty"):
        WorkerConfig(auth_token_file=str(tmp_path / "empty"))
