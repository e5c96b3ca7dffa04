"""The client API's faults found by session 38's audit, each pinned: a write buffer outliving its client or its
connection, a forked child giving back its parent's leases, close() held up by another thread's wait, a request that
cannot be encoded losing the releases riding with it, and arguments taken for what they are not."""

from __future__ import annotations

import gc
import os
import socket
import threading
import time

import pytest

import kvstrata
from kv_helpers import wait_until, worker_fixtures
from kvstrata.errors import CapacityError, ClosedError, ConnectionLost, InvalidType, InvalidValue

MEMORY = 32 << 20

worker, kv = worker_fixtures("faults-s38", memory=MEMORY, segment=8 << 20)


def _mine(worker, name: str) -> dict:
    """The worker's record of the client connected as ``name`` (its leases, its open writes)."""
    (entry,) = [c for c in worker.stats()["client_list"] if c["name"].endswith(f"({name})")]
    return entry


# 1. a write buffer once its write is over ------------------------------------------------------------------------
def test_a_buffer_refuses_writes_once_its_client_closed(kv):
    buf = kv.create("x", 4096)
    kv.close()  # the write is aborted with the client: its bytes may go to another object
    with pytest.raises(ClosedError, match="its client is closed"):
        buf.write(b"EVIL" * 1024)
    for take_a_view in (buf.memoryview, buf.numpy, buf.tensor):
        with pytest.raises(ClosedError):
            take_a_view()


def test_a_closed_clients_buffer_writes_nothing_into_another_clients_object(worker):
    writer = kvstrata.connect(worker.address, timeout=5)
    with kvstrata.connect(worker.address, timeout=5) as other:
        buf = writer.create("x", 4096)
        writer.close()  # the worker aborts the write and frees its bytes
        other.set("victim", b"v" * 4096)  # (the same bytes, as the worker hands them out)
        with pytest.raises(ClosedError):
            buf.write(b"EVIL" * 1024)
        assert other.get("victim") == b"v" * 4096


def test_a_buffer_refuses_writes_once_its_connection_is_lost(worker):
    with kvstrata.connect(worker.address, timeout=5) as writer, kvstrata.connect(worker.address, timeout=5) as other:
        buf = writer.create("x", 4096)
        # The connection ends under the client (the worker aborts its writes): the client learns it at its next call
        with socket.socket(fileno=os.dup(writer._backend._conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
        with pytest.raises(ConnectionLost):
            writer.stats()  # (not a ping: one may go through the lane, in shared memory)
        assert wait_until(lambda: worker.stats()["clients"] == 1)  # the worker let go of the writer's write
        other.set("victim", b"v" * 4096)
        with pytest.raises(ConnectionLost, match="aborted the write"):
            buf.write(b"EVIL" * 1024)
        with pytest.raises(ConnectionLost):
            buf.numpy()
        assert other.get("victim") == b"v" * 4096


# 2. a forked child's copies of the parent's views --------------------------------------------------------------
def test_a_forked_child_letting_go_of_views_leaves_the_parents_leases(worker):
    with kvstrata.connect(worker.address, name="fork-parent") as kv, kvstrata.connect(worker.address) as other:
        kv.set("k", b"v" * 4096, ttl=3600)  # (a TTL: not kept by the local-read cache, the view's lease alone)
        kv.set("k2", b"w" * 4096, ttl=3600)
        view = kv.get_buffers(["k"])[0]
        dropped = kv.get_buffers(["k2"])[0]
        assert _mine(worker, "fork-parent")["leases"] == 2
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: release one copy, drop the other (its finalizer), and close the client
            code = 0
            try:
                view.release()
                del dropped
                gc.collect()
                kv.close()
            except BaseException:
                code = 1
            os.write(w, bytes([code]))
            os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"\x00"
        os.close(r)
        os.waitpid(pid, 0)
        kv.ping()  # (anything the child sent is handled before this answer)
        assert _mine(worker, "fork-parent")["leases"] == 2
        other.delete(["k", "k2"])
        other.set("other", b"X" * 4096)  # (what a lease given back would let the store hand out again)
        assert not view.released and bytes(view) == b"v" * 4096
        assert bytes(dropped) == b"w" * 4096


# 3. close() beside another thread's wait -----------------------------------------------------------------------
@pytest.mark.parametrize("timeout", [None, 30.0], ids=["forever", "30s"])
def test_close_ends_another_threads_wait_at_once(kv, worker, timeout):
    kv.set("held", b"h" * 4096, ttl=3600)
    view = kv.get_buffers(["held"])[0]
    leases = worker.stats()["leases"]
    got: dict = {}

    def wait_for_a_key() -> None:
        try:
            got["value"] = kv.get("never", timeout=timeout)
        except Exception as exc:
            got["error"] = exc

    waiter = threading.Thread(target=wait_for_a_key, daemon=True)
    waiter.start()
    time.sleep(0.3)  # the get is waiting in the worker (or the store)
    start = time.monotonic()
    kv.close()
    took = time.monotonic() - start
    waiter.join(2)
    assert not waiter.is_alive()
    assert took < 1.5, f"close() took {took:.2f} s"
    assert isinstance(got.get("error"), ClosedError | ConnectionLost), got
    assert view.released
    if not kv.embedded:  # the worker let go of the client's lease before close() returned
        assert worker.stats()["leases"] == leases - 1


# 4. a request that cannot be encoded -----------------------------------------------------------------------------
def test_an_unencodable_key_is_refused_naming_it(kv):
    kv.set("ok", b"1")
    with pytest.raises(InvalidValue, match=r"^key: not encodable as UTF-8 \(lone surrogate\?\)"):
        kv.get("s\ud800")
    with pytest.raises(InvalidValue, match=r"^key: not encodable"):
        kv.set("s\ud800", b"x")
    with pytest.raises(InvalidValue, match=r"^keys\[1\]: not encodable"):
        kv.exists(["ok", "bad\udfff"])
    with pytest.raises(InvalidValue, match=r"^keys\[0\]: not encodable"):
        kv.mget(["\udfff" * 300])  # (long: a key of over 256 characters took another way)
    assert kv.exists(["ok", "\u00e9t\u00e9", "\U0001f600"]) == [True, False, False]  # other non-ASCII keys pass
    with pytest.raises(InvalidValue, match="1028 bytes long"):
        kv.get("\U0001f600" * 257)
    assert kv.get("ok") == b"1"


@pytest.mark.parametrize(
    ("call", "refused", "message"),
    [
        (lambda kv: kv.read("k", 2**64, 1), InvalidValue, "^offset: "),
        (lambda kv: kv.read("k", 2**63, 1), InvalidValue, "^offset: "),
        (lambda kv: kv.read("k", 0, 2**64), InvalidValue, "^size: "),
        (lambda kv: kv.read("k", 1, 2**63 - 1), InvalidValue, "^size: "),
        (lambda kv: kv.create("c", 2**64), CapacityError, "^size: "),
    ],
    ids=["offset-2**64", "offset-2**63", "size-2**64", "range-past-2**63", "create-2**64"],
)
def test_sizes_and_offsets_past_any_object_are_refused_naming_them(kv, call, refused, message):
    kv.set("k", b"0123456789")
    with pytest.raises(refused, match=message):
        call(kv)
    assert kv.read("k", 2, 3) == b"234"


def test_a_request_that_cannot_be_encoded_keeps_the_releases_and_aborts_riding_with_it(worker):
    with kvstrata.connect(worker.address, name="unencodable", timeout=5) as kv:
        backend = kv._backend
        kv.set("big", b"x" * 8192, ttl=3600)  # (a TTL: the lease is the view's alone)
        views = kv.get_buffers(["big"])
        kv.create("w", 100)  # dropped at once: its write is aborted with the next request
        del views
        gc.collect()
        assert _mine(worker, "unencodable")["leases"] == 1
        assert _mine(worker, "unencodable")["open_writes"] == 1
        # Past the client's checks (a caller of the backend): the request fails to encode, plain and pipelined
        for send in (
            lambda: backend.request({"op": "get", "key": "s\ud800", "timeout": 0}),
            lambda: backend.request({"op": "read", "key": "big", "offset": 2**64, "size": 1}),
            lambda: backend.send_tagged({"op": "acquire", "keys": ["s\ud800"], "timeout": 0}),
        ):
            with pytest.raises(InvalidType, match="cannot encode"):
                send()
            # (the release may have gone meanwhile with the local-read cache's keeper; the abort waits for a request)
            assert "w" in backend._deferred_aborts and not backend._untagged_due
        assert kv.get_buffers(["big"])[0].release() is None  # (pipelined and ordinary requests both still work)
        kv.ping()
        assert _mine(worker, "unencodable")["leases"] == 0
        assert _mine(worker, "unencodable")["open_writes"] == 0


# 5. arguments taken for what they are not --------------------------------------------------------------------------
@pytest.mark.parametrize("nx", ["no", None, 1, 0.0], ids=["str", "None", "int", "float"])
def test_nx_must_be_a_bool(kv, nx):
    with pytest.raises(InvalidType, match=r"^nx: must be a bool"):
        kv.set("nx", b"1", nx=nx)
    with pytest.raises(InvalidType, match=r"^nx: must be a bool"):
        kv.mset([("nx", b"1"), ("nx", b"2")], nx=nx)  # (a key named twice: nx decides which pair stands)
    with pytest.raises(InvalidType, match=r"^nx: must be a bool"):
        kv.create("nx", 16, nx=nx)
    assert kv.exists("nx") is False


@pytest.mark.parametrize("call", ["mget", "delete", "exists", "get_buffers", "size", "incref"])
def test_a_closed_client_refuses_an_empty_batch(kv, call):
    kv.close()
    with pytest.raises(ClosedError):
        getattr(kv, call)([])


@pytest.mark.parametrize("keys", [b"ab", bytearray(b"ab"), memoryview(b"ab")], ids=["bytes", "bytearray", "view"])
def test_a_bytes_object_is_refused_as_keys(kv, keys):
    with pytest.raises(InvalidType, match=rf"^keys: expected a str or an iterable of str, got {type(keys).__name__}"):
        kv.delete(keys)
    with pytest.raises(InvalidType, match=r"^keys: "):
        kv.mget(keys)


@pytest.mark.parametrize("offset, size, blamed", [(20, 1, "offset"), (4, 20, "size"), (10, 1, "size")])
def test_a_read_outside_the_value_blames_the_argument_at_fault(kv, offset, size, blamed):
    kv.set("ten-bytes", b"0123456789")
    with pytest.raises(InvalidValue, match=f"^{blamed}: range"):
        kv.read("ten-bytes", offset, size)
