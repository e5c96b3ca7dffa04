"""The worker's metrics and status under many clients (audit s38): idle connections to ``/metrics``, a status
probe among more clients than the worker lists, requests of killed clients, counters' types, one deadline."""

from __future__ import annotations

import argparse
import socket
import threading
import time
import urllib.request

import pytest

from kv_helpers import wait_until
from kvstrata.server.http_metrics import LISTEN_BACKLOG, MetricsServer

STATS = {"objects": 3, "clients": 1}


def _closed_by_the_server(conn: socket.socket, timeout: float) -> bool:
    """Whether the server closed ``conn`` (an empty read, or a reset) within ``timeout`` seconds."""
    conn.settimeout(timeout)
    try:
        while conn.recv(4096):  # (an answer to half a request, if any, then the end)
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _scrape(url: str) -> str:
    return urllib.request.urlopen(url, timeout=5).read().decode()


@pytest.fixture
def idle_server():
    server = MetricsServer(lambda: STATS, "127.0.0.1", 0, timeout=0.5, max_connections=4)
    yield server
    server.stop()


def _connect_idle(server: MetricsServer, n: int) -> list[socket.socket]:
    host, port = server._httpd.server_address[:2]
    held = []
    for i in range(n):
        conn = socket.create_connection((host, port), timeout=2)
        if i % 2:  # half a request, never finished
            conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        held.append(conn)
    return held


def test_idle_metrics_connections_are_closed_after_the_timeout_and_a_scrape_works_meanwhile(idle_server):
    held = _connect_idle(idle_server, 3)  # fewer than the cap: a scrape has a slot
    try:
        assert "kvstrata_objects 3" in _scrape(idle_server.url)
        start = time.monotonic()
        assert all(_closed_by_the_server(conn, timeout=3) for conn in held)
        assert time.monotonic() - start < 2.5  # closed by the 0.5 s timeout, not by the test's own
    finally:
        for conn in held:
            conn.close()
    assert "kvstrata_objects 3" in _scrape(idle_server.url)


def test_connections_beyond_the_cap_are_closed_at_once_and_threads_stay_bounded(idle_server, caplog):
    before = threading.active_count()
    with caplog.at_level("DEBUG", logger="kvstrata.server.http_metrics"):
        held = _connect_idle(idle_server, 40)
        try:
            time.sleep(0.2)
            assert threading.active_count() <= before + 4  # a thread per connection served, no more
            # those beyond the cap were closed unanswered, the first four are closed by their timeout
            assert all(_closed_by_the_server(conn, timeout=3) for conn in held)
        finally:
            for conn in held:
                conn.close()
        assert "closed 1 connection(s) unanswered: 4 are open already" in caplog.text  # warned once, not 36 times
        assert caplog.text.count("WARNING") == 1
    assert wait_until(lambda: threading.active_count() <= before)
    assert "kvstrata_objects 3" in _scrape(idle_server.url)  # their slots are free again


def test_the_metrics_server_listens_with_a_normal_backlog(idle_server):
    assert idle_server._httpd.request_queue_size == LISTEN_BACKLOG >= 128  # (socketserver's default is 5)


def test_a_scraper_that_hangs_up_mid_reply_is_a_debug_line_not_a_traceback(capfd, caplog):
    answering = threading.Event()

    def slow_stats() -> dict:
        answering.set()
        time.sleep(0.3)  # the scraper hangs up meanwhile
        return {"big": {f"k{i}": i for i in range(20000)}}  # more than a socket buffer: the write fails

    server = MetricsServer(slow_stats, "127.0.0.1", 0, timeout=2)
    try:
        with caplog.at_level("DEBUG", logger="kvstrata.server.http_metrics"):
            for _ in range(3):
                answering.clear()
                conn = socket.create_connection(server._httpd.server_address[:2], timeout=2)
                conn.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                assert answering.wait(2)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()  # a reset: the worker's write finds the connection gone
            assert wait_until(lambda: caplog.text.count("went away") == 3), caplog.text
        assert "WARNING" not in caplog.text and "ERROR" not in caplog.text
        assert "Traceback" not in capfd.readouterr().err  # (socketserver's handle_error printed one each)
    finally:
        server.stop()


def test_status_prometheus_leaves_itself_out_of_more_clients_than_the_worker_lists(worker, capsys):
    from kvstrata.cli.status import fetch_stats, run
    from kvstrata.server.worker import CLIENT_LIST_MAX
    from kvstrata.transport import connect

    n = CLIENT_LIST_MAX + 6  # the worker's list names 64 of them: the status probe is not among them
    conns = [connect(worker.address, timeout=10, hello={"shm": False, "name": f"c{i}"}) for i in range(n)]
    try:
        assert wait_until(lambda: worker.stats()["clients"] == n)
        args = argparse.Namespace(address=worker.address, prometheus=True, timeout=5.0, cluster=None)
        assert run(args) == 0
        assert f"\nkvstrata_clients {n}\n" in capsys.readouterr().out
        # (each probe's connection is let go by the worker's thread after it closed: wait for that before the next)
        assert wait_until(lambda: worker.stats()["clients"] == n)
        stats, _ = fetch_stats(worker.address, timeout=5, leave_out_self=True)
        assert stats["clients"] == n and len(stats["client_list"]) == CLIENT_LIST_MAX
        assert wait_until(lambda: worker.stats()["clients"] == n)
        stats, _ = fetch_stats(worker.address, timeout=5)  # the human summary counts itself, as README says
        assert stats["clients"] == n + 1
    finally:
        for conn in conns:
            conn.close()
    # fewer clients: the probe is listed, and taken out of both the count and the list
    assert wait_until(lambda: worker.stats()["clients"] == 0)
    stats, _ = fetch_stats(worker.address, timeout=5, leave_out_self=True)
    assert stats["clients"] == 0 and stats["client_list"] == []


def test_without_self_of_a_worker_that_does_not_describe_the_asker_takes_out_its_pid():
    import os

    from kvstrata.cli.status import without_self

    stats = {"clients": 2, "client_list": [{"name": "a", "pid": os.getpid()}, {"name": "b", "pid": -1}]}
    assert without_self(stats) == {"clients": 1, "client_list": [{"name": "b", "pid": -1}]}
    asker = {"name": "a", "pid": os.getpid(), "counted": True}
    assert without_self({"clients": 70, "client_list": []}, asker)["clients"] == 69  # listed or not


def test_a_wait_of_a_client_that_vanished_is_not_counted_as_refused(worker):
    from kvstrata.transport import connect

    conn = connect(worker.address, timeout=5, hello={"shm": False, "name": "killed"})
    conn.send({"op": "get", "key": "never", "timeout": 30})
    time.sleep(0.3)  # waiting in the store
    conn.close()  # as a SIGKILL would: the socket hangs up, no bye
    assert wait_until(lambda: worker.stats()["clients"] == 0)
    assert worker.stats()["request_errors"] == 0
    # a refused request of a client still there is still counted
    with connect(worker.address, timeout=5, hello={"shm": False}) as live:
        live.send({"op": "no such op"})
        assert "err" in live.recv(timeout=5)[0]
    assert worker.stats()["request_errors"] == 1


def test_retired_segments_are_a_counter():
    from kvstrata.server.metrics import to_prometheus

    text = to_prometheus({"tiers": {"memory": {"retired_segments": 3, "segments": 2}}})
    assert "# TYPE kvstrata_tier_retired_segments_total counter" in text
    assert 'kvstrata_tier_retired_segments_total{tier="memory"} 3' in text
    assert "# TYPE kvstrata_tier_segments gauge" in text


def test_a_key_wait_timeout_message_rounds_the_seconds(worker):
    from kvstrata.transport import connect

    with connect(worker.address, timeout=5, hello={"shm": False}) as conn:
        conn.send({"op": "get", "key": "never", "timeout": 0.0123456789})
        reply, _ = conn.recv(timeout=5)
    assert reply["err"][0] == "Timeout" and "within 0.012 s" in reply["err"][1], reply


def test_status_waits_for_the_handshake_and_the_stats_within_one_timeout(tmp_path):
    from kvstrata.cli.status import fetch_stats
    from kvstrata.errors import Timeout
    from kvstrata.transport import listen

    done = threading.Event()

    def slow_hello(conn, hello):
        time.sleep(1.0)  # half the timeout goes on the handshake (the other half leaves it room on a loaded machine)
        return {}, []

    def mute(conn):  # takes the stats request, never answers
        done.wait(5)
        conn.close()

    lst = listen(f"unix://{tmp_path}/slow.sock", mute, on_hello=slow_hello)
    try:
        start = time.monotonic()
        with pytest.raises(Timeout, match=r"did not send its stats within 2 s"):
            fetch_stats(lst.address, timeout=2.0)
        assert time.monotonic() - start < 2.9  # (the stats had two seconds of their own: 3 s)
    finally:
        done.set()
        lst.stop()
