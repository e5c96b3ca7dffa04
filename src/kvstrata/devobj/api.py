"""Client side of device objects: dev_publish / dev_subscribe, dev_mset / dev_mget, dev_broadcast.

:class:`DeviceObjects` talks to a :class:`~kvstrata.devobj.broker.DeviceBroker` through a
:class:`BrokerLink` (``call(op, args, timeout) -> dict``): :class:`InprocBrokerLink` for tests and the
embedded mode, the worker connection for the real client (it forwards ``dev.<op>`` requests). No call
blocks on a peer: publishes register and return futures (a publish first waits, on the host, for the
caller's stream to reach the publish point, so what it registers is complete); subscribes register
waiters and return futures; one thread per client long-polls the broker for events (matches, completions, timeouts) and
hands the copies to a small pool. Copies run on this client's own transfer streams, ordered after the
caller's current stream at the time of the call.

This module holds the public methods, the client's state and its lifetime; the work is in parts, one
concept each, mixed into :class:`DeviceObjects`:

* :mod:`~kvstrata.devobj.publish`: the owner's side (exports, registration, release of owned objects);
* :mod:`~kvstrata.devobj.request`: subscribe / mget requests, cached reads, stages, cancellation;
* :mod:`~kvstrata.devobj.receive`: the copies of matched transfers, their checks and completions;
* :mod:`~kvstrata.devobj.events`: the event thread (long poll, dispatch of broker events);
* :mod:`~kvstrata.devobj.broadcast`: a broadcast receiver's chain step;
* :mod:`~kvstrata.devobj.nccl_ends`: this client's ends of the NCCL path.

Example (two processes on one node, through a worker)::

    objs = DeviceObjects(link)                           # in process A
    fut, = objs.dev_publish(["w"], [[weights]])
    objs_b.dev_subscribe(["w"], [[buffer]])[0].result()  # in process B: buffer == weights
    fut.result()                                         # A: B has it all; A's tensors are released
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import torch

from kvstrata import errors
from kvstrata._proc import PID
from kvstrata.devobj._core import PidWatch
from kvstrata.devobj._core import Want as _Want
from kvstrata.devobj.broadcast import BroadcastReceiver
from kvstrata.devobj.debug import configure_from_env
from kvstrata.devobj.events import GOODBYE_S, EventThread
from kvstrata.devobj.ipc import EventPool, ImportCache, StreamSet
from kvstrata.devobj.lead import PollRole, lead_enabled, lead_spin_seconds
from kvstrata.devobj.link import (
    BrokerLink,
    DeviceObjectConfig,
    InprocBrokerLink,
    check_keys,
    check_tensor_lists,
    error_from,
)
from kvstrata.devobj.nccl_ends import NcclEnds
from kvstrata.devobj.offers import OfferBox, offers_enabled
from kvstrata.devobj.publish import Publisher, _Owned
from kvstrata.devobj.receive import CopyReceiver
from kvstrata.devobj.request import Requester
from kvstrata.errors import InvalidValue

log = logging.getLogger(__name__)


class DeviceObjects(Publisher, Requester, EventThread, NcclEnds, BroadcastReceiver, CopyReceiver):
    """Device-object operations of one client (one GPU). Thread-safe; ``close()`` when done."""

    def __init__(
        self,
        link: BrokerLink,
        *,
        device: torch.device | int | str | None = None,
        config: DeviceObjectConfig | None = None,
    ) -> None:
        configure_from_env()
        self._pid = PID[0]
        self.config = config or DeviceObjectConfig()
        self.link = link
        self.device = self._pick_device(device)
        self._cuda = self.device.type == "cuda"
        self._lock = threading.RLock()
        self._closed = False
        self._wants: dict[int, _Want] = {}  # by wid, until matched
        self._inflight: dict[int, _Want] = {}  # by tid
        self._owned: dict[int, _Owned] = {}  # by broker object id
        self._early: dict[tuple[str, int], list[dict[str, Any]]] = {}  # events ahead of their receive (_park)
        # when each key of _early was parked, oldest first: the same keys as _early (see _park, _take_early)
        self._early_at: OrderedDict[tuple[str, int], float] = OrderedDict()
        self._cancelled: set[int] = set()  # wids withdrawn by their caller
        self._read: dict[int, tuple[str, list[dict[str, Any]], str]] = {}  # obj -> (owner, handles, key) read
        self._bcast_log: deque[dict[str, Any]] = deque(maxlen=64)  # see broadcast_log()
        # Reads with no broker round trip: the broker's generation (None: not offered) and, per key read
        # before, (generation read before the request that returned it, record). See _receive.
        self._gen = getattr(link, "generation_counter", None)
        self._records: dict[str, tuple[int, dict[str, Any]]] = {}
        self.cached_reads = 0  # keys read without asking the broker (for tests and benchmarks)
        self._pids = PidWatch()  # owners' processes, checked after each copy from them
        self._handoffs: list[Future] = []  # settled by the event thread, their waiters not yet let in (_poll_sent)
        # Completions of finished receives (see _report_done): queued, and sent with a poll but not yet
        # known read by the broker (by tid; repeated with every request until then, see _call).
        self._done_items: list[dict[str, Any]] = []
        self._unacked: dict[int, dict[str, Any]] = {}
        self._flush_lock = threading.Lock()
        self._helper = threading.local()  # .on: this thread is one of this client's own
        # Helper threads start with GPU 0 current (CUDA's per-thread default): make it this client's GPU,
        # so streams, events and torch's per-device current streams in them are the client's.
        # (the initializer holds what it sets, not this client: the pool's threads and their work queue would
        # otherwise keep a reference cycle through it, freed by the cyclic GC alone)
        self._pool = ThreadPoolExecutor(
            self.config.copy_threads,
            thread_name_prefix="kvstrata-devobj",
            initializer=functools.partial(_init_helper_thread, self._helper, self.device if self._cuda else None),
        )
        self._events = EventPool() if self._cuda else None
        self._imports = ImportCache() if self._cuda else None
        self._streams = StreamSet() if self._cuda else None
        self._nccl = None
        info = {"pid": os.getpid(), "node_id": self.config.node_id, "device": self._device_info()}
        if self._cuda:
            from kvstrata.devobj.ipc import device_uuid

            info["visible"] = [device_uuid(i) for i in range(torch.cuda.device_count())]
        self.link.call("hello", {"info": info})
        log.debug("devobj: client %s on %s started (pid %d)", getattr(link, "client_id", "?"), self.device, os.getpid())
        # The link calls _poll_sent between sending a poll and waiting for its answer, where it can
        # (else _poll calls it before the poll: the poll then goes out a little later).
        self._hook = hasattr(link, "on_poll_sent")
        if self._hook:
            link.on_poll_sent = self._poll_sent
        # Leader/follower (kvstrata.devobj.lead): where the event connection can be waited on, a thread
        # waiting for a receive reads it itself. The poll sent and not yet answered (the completions it
        # carries; None: none out) and whether the connection is over are the role holder's.
        fileno = getattr(link, "poll_fileno", None)
        fd = fileno() if callable(fileno) else None
        # Direct offers (kvstrata.devobj.offers): where the worker shares its hints of waiting subscribers and
        # this client's events are read by whoever holds the role, which then watches the offer box too.
        self._offer_table = getattr(link, "offer_table", None) if fd is not None and lead_enabled() else None
        self._offer_box: OfferBox | None = None
        if self._offer_table is not None and offers_enabled():
            try:
                self._offer_box = OfferBox(link.client_id)
            except OSError as exc:
                log.info("devobj: no offer box (%s); hand-offs go through the broker alone", exc)
        #: whether this client's publishes send offers (where it has a box); switched call by call by A/B probes
        #: (tools/probe_handoff.py)
        self.send_offers = True
        self.offers_taken = 0  # offers whose copy started here (for tests and benchmarks)
        self.offers_used = 0  # of those, receives finished from the offer's copy
        #: receives that took an offer, their match not seen yet: wid -> (key, the export taken); see
        #: CopyReceiver._on_offer and _offer_fate
        self._taken: OrderedDict[int, tuple] = OrderedDict()
        box_fd = self._offer_box.fileno() if self._offer_box is not None else None
        self._role = PollRole(fd, box_fd) if fd is not None and lead_enabled() else None
        self._poll_carried: list[dict[str, Any]] | None = None
        self._poll_over = False
        self._leftover: list[dict[str, Any]] = []  # events of an answer whose reader was interrupted
        self._lead_spin = lead_spin_seconds()
        #: whether a thread waiting for a receive may read its match itself (where the link allows it at all);
        #: switched call by call by A/B probes (tools/devobj_latency_cpu.py --ab)
        self.lead_waiters = True
        self._poller = threading.Thread(target=self._poll_main, name="kvstrata-devobj-poll", daemon=True)
        self._poller.start()

    # -- public API -------------------------------------------------------------------------------
    def dev_publish(self, keys: Sequence[str], tensor_lists: Sequence[Sequence[torch.Tensor]]) -> list[Future]:
        """One-shot hand-off: each future completes once a subscriber received the key in full.

        Until then this client keeps the tensors alive (the caller may drop its references), and
        must not modify them.
        """
        keys, lists = self._check(keys, tensor_lists)
        return self._register("publish", keys, lists)

    def dev_subscribe(
        self, keys: Sequence[str], tensor_lists: Sequence[Sequence[torch.Tensor]], timeout: float | None = None
    ) -> list[Future]:
        """Receive published (or broadcast) keys into ``tensor_lists``; each future waits up to ``timeout``.

        A subscribe waits for ``dev_publish``/``dev_broadcast`` keys (``dev_mget`` reads ``dev_mset`` ones).
        Cancelling a future that is still waiting withdraws it; once matched, the copy runs to the end.
        """
        keys, lists = self._check(keys, tensor_lists)
        return self._receive("subscribe", keys, lists, timeout)

    def dev_mset(self, keys: Sequence[str], tensor_lists: Sequence[Sequence[torch.Tensor]]) -> list[Exception | None]:
        """Register keys whose data stays in this client's tensors; per-key ``None`` or the error.

        Readers copy straight from these tensors, after the work queued on the caller's stream at
        this call. Write-once: to change the data, ``dev_delete`` (in-flight reads finish first),
        write, and register again.
        """
        keys, lists = self._check(keys, tensor_lists)
        futures = self._register("mset", keys, lists)
        return [f.exception() if f.done() else None for f in futures]

    def dev_mget(
        self, keys: Sequence[str], tensor_lists: Sequence[Sequence[torch.Tensor]], timeout: float | None = None
    ) -> list[Future]:
        """Copy registered keys from their owners' GPUs into ``tensor_lists`` (any number of times)."""
        keys, lists = self._check(keys, tensor_lists)
        return self._receive("mget", keys, lists, timeout)

    def dev_broadcast(
        self, key: str, tensor_list: Sequence[torch.Tensor], receivers: int, chunk_bytes: int | None = None
    ) -> Future:
        """Send one key to ``receivers`` subscribers, pipelined in chunks, one copying process per GPU.

        Receivers call :meth:`dev_subscribe` as usual. Once all have subscribed, one receiver per GPU
        (its leader) pulls chunk ``c`` from the sender, or from the previous GPU's leader as soon as
        that one has it, and copies it on to the other receivers of its GPU (shared-memory progress
        counters, see :mod:`kvstrata.devobj.chain`), so N receivers finish in about one copy plus a
        chunk or two; each GPU link is crossed once. ``chunk_bytes`` is the least chunk (big objects
        get larger ones, :func:`kvstrata.devobj.chain.chunk_size`). Every receiver's
        future, and this one, completes when all receivers have everything; if any receiver fails
        or goes away, all of them fail (none reports a partial object as received).
        """
        if not isinstance(receivers, int) or isinstance(receivers, bool) or receivers < 1:
            raise InvalidValue(f"receivers: expected a positive int, got {receivers!r}")
        chunk = self.config.chunk_bytes if chunk_bytes is None else chunk_bytes
        if not isinstance(chunk, int) or chunk < 4096:
            raise InvalidValue(f"chunk_bytes: expected an int >= 4096, got {chunk_bytes!r}")
        keys, lists = self._check([key], [tensor_list])
        return self._register("broadcast", keys, lists, receivers=receivers, chunk_bytes=chunk)[0]

    def dev_delete(self, keys: Sequence[str]) -> list[Exception | None]:
        """Remove keys this client registered or published; per-key ``None`` or the error.

        Each key is free for a new registration at once. Reads of a deleted object already in flight finish
        first: this call returns once they did, so the caller may then write to the tensors (later reads no
        longer find the key). Should those reads not finish within ``config.copy_timeout``, the key
        gets ``Timeout`` (its tensors may still be read). Called from a future's callback (this client's event
        thread, which hears when reads end), it returns at once instead, without waiting.
        """
        keys = self._check_keys(keys)
        results = self._call("delete", {"keys": keys})["results"]
        out: list[Exception | None] = []
        reading: dict[int, Future] = {}  # position -> the object's release, for objects read at the delete
        for i, r in enumerate(results):
            if not r.get("ok"):
                out.append(error_from(r.get("error"), r.get("message", "")))
                continue
            out.append(None)
            if not r.get("pending"):
                self._release(r["obj"], errors.KeyNotFound("deleted before anyone received it"))
                continue
            with self._lock:
                owned = self._owned.get(r["obj"])
            if owned is not None and owned.future is not None:
                reading[i] = owned.future
        if reading and not self._is_event_thread():
            _, late = futures_wait(list(reading.values()), timeout=self.config.copy_timeout)
            for i, fut in reading.items():
                if fut in late:
                    out[i] = errors.Timeout(
                        f"device object {keys[i]!r} deleted, but reads of it in flight did not finish within "
                        f"{self.config.copy_timeout} s: do not write to its tensors yet"
                    )
        return out

    def dev_local_delete(self, keys: Sequence[str]) -> None:
        """Drop this process's cached imports of ``keys`` (closing the IPC mappings that pin the owners' memory)."""
        keys = self._check_keys(keys)
        with self._lock:
            for k in keys:
                self._records.pop(k, None)
            gone = [o for o, (_, _, k) in self._read.items() if k in keys]
            entries = [(o, self._read.pop(o)) for o in gone]
        for obj, (owner, handles, _) in entries:
            if self._imports is not None:
                self._imports.drop_handles(owner, handles, obj=obj)
        self._call("local_delete", {"keys": keys})

    def close(self) -> None:
        """Leave the broker (owned keys vanish), fail pending futures, stop threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._goodbye()
        self._fail_all(errors.ClosedError("device-object client closed"))
        if self._role is not None:
            self._role.close()
        if threading.current_thread() is not self._poller:  # close() may run in a future's callback
            self._poller.join(timeout=self.config.poll_seconds + 1)
        if not self._poller.is_alive():  # else they go with the process
            if self._offer_box is not None:
                self._offer_box.close()
            if self._role is not None:
                self._role.release()
            # Let go of the link's maps (the broker's generation page and offer table) and of the hook that ties
            # the link to this client (a reference cycle): the link's close() can then unmap them and close their
            # descriptors at once, instead of whenever the cyclic GC frees this client. Readers of these take
            # them once into a local and treat None as "closed".
            self._gen = None
            self._offer_table = None
            if self._hook and getattr(self.link, "on_poll_sent", None) == self._poll_sent:
                self.link.on_poll_sent = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._nccl is not None:
            self._nccl.close()
        self._pids.close()

    def _goodbye(self) -> None:
        """Tell the broker this client leaves (its owned keys vanish, what it had matched goes back), with what
        it received here that the broker may not know of yet."""
        self._flush_done()  # the broker hears of every finished receive before this client leaves
        with self._lock:  # and of those sent with a poll it may not have read yet (it ignores repeats)
            unacked = list(self._unacked.values())
            # and of offers taken here whose match it has not confirmed: the objects they took are received
            taken = [[wid, key, list(export)] for wid, (key, export) in self._taken.items()]
        args: dict[str, Any] = {"done": unacked} if unacked else {}
        if taken:
            args["taken"] = taken
        try:
            self.link.call("goodbye", args, GOODBYE_S)
        except Exception as exc:  # the worker may be gone already
            log.debug("devobj goodbye: %s", exc)

    def __enter__(self) -> DeviceObjects:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def debug_state(self) -> dict[str, Any]:
        """What this client is waiting for, for failure messages: receives, transfers, owned keys, threads."""
        with self._lock:
            return {
                "client": getattr(self.link, "client_id", "?"),
                "device": str(self.device),
                "closed": self._closed,
                "poller_alive": self._poller.is_alive(),
                "waiting": {w: want.key for w, want in self._wants.items()},
                "in_flight": {t: want.key for t, want in self._inflight.items()},
                "owned": {o: (x.key, x.mode) for o, x in self._owned.items()},
                "early": {f"{k[0]}:{k[1]}": [e.get("type") for e in v] for k, v in self._early.items()},
                "copy_queue": self._pool._work_queue.qsize(),
                "offers": {
                    "box": self._offer_box is not None,
                    "sent": self._offer_box.sent if self._offer_box is not None else 0,
                    "refused": self._offer_box.refused if self._offer_box is not None else 0,
                    "taken": self.offers_taken,
                    "used": self.offers_used,
                },
            }

    def _device_guard(self) -> Any:
        """This client's GPU current for the block, where the calling thread has another (a leading waiter)."""
        if self._cuda and torch.cuda.current_device() != self.device.index:
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def _thread_init(self) -> None:
        _init_helper_thread(self._helper, self.device if self._cuda else None)

    # -- validation -------------------------------------------------------------------------------
    def _pick_device(self, device: torch.device | int | str | None) -> torch.device:
        if device is None:
            if torch.cuda.is_available():
                return torch.device("cuda", torch.cuda.current_device())
            if self.config.allow_cpu:
                return torch.device("cpu")
            raise InvalidValue("device: no CUDA device here (device objects live in GPU memory)")
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.type == "cpu" and not self.config.allow_cpu:
            raise InvalidValue("device: device objects live in GPU memory; cpu needs config allow_cpu=True")
        return dev

    def _device_info(self) -> dict[str, Any]:
        return dict(self._device_record())

    def _device_record(self) -> dict[str, Any]:
        """This client's device as records carry it: one dict, shared by every record (never changed)."""
        info = self.__dict__.get("_devinfo")
        if info is None:
            if self.device.type != "cuda":
                info = {"uuid": f"cpu:{self.config.node_id}", "index": -1}
            else:
                from kvstrata.devobj.ipc import device_uuid

                info = {"uuid": device_uuid(self.device.index), "index": self.device.index}
            self._devinfo = info
        return info

    def _check_open(self) -> None:
        """Raise when calls can no longer complete: this client closed, or its broker lost (no event would come
        to settle a future)."""
        if self._closed:
            raise errors.ClosedError("device-object client closed")
        if self._pid != PID[0]:  # its connections, threads and registrations are the parent's
            raise errors.ClosedError("device objects were started before fork(): connect again in this process")
        if self._poll_over:
            raise errors.ConnectionLost(
                "this client's device-object events stopped (broker lost, or its event thread died: see the log); "
                "make a new client"
            )

    def _check_keys(self, keys: Sequence[str]) -> list[str]:
        self._check_open()
        return check_keys(keys)

    def _check(self, keys: Sequence[str], tensor_lists: Sequence[Sequence[torch.Tensor]]):
        self._check_open()
        return check_tensor_lists(keys, tensor_lists, self.device, allow_cpu=self.config.allow_cpu)


def _init_helper_thread(helper: threading.local, device: torch.device | None) -> None:
    """Start one of a client's own threads (event or copy thread): marked in ``helper`` (see ``_notify_done``), on the
    client's GPU where it has one (helper threads start with GPU 0 current, CUDA's per-thread default)."""
    helper.on = True
    if device is not None:
        torch.cuda.set_device(device)


__all__ = [
    "BrokerLink",
    "DeviceObjectConfig",
    "DeviceObjects",
    "InprocBrokerLink",
    "check_keys",
    "check_tensor_lists",
    "error_from",
]
