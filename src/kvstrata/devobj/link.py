"""What the device-object client is given: the broker link, its settings, its arguments' checks.

:class:`BrokerLink` is the seam to the broker (``call(op, args, timeout) -> dict``): the in-process
:class:`InprocBrokerLink` here, the worker connection in :mod:`kvstrata.devobj.service`.
Arguments are checked before anything is registered or copied; broker error codes become the
exceptions users catch (:func:`error_from`).
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvstrata import errors
from kvstrata.devobj import broker as B
from kvstrata.errors import InvalidType, InvalidValue, OwnerGone, TransferAborted
from kvstrata.server.protocol import FOREVER_S, MAX_KEY_BYTES


class BrokerLink(Protocol):
    """How a client reaches the broker: one request/response call per operation. A link may also offer
    ``notify(op, args)``: the request with no answer (sent in order with ``call``'s, nothing waits)."""

    client_id: str

    def call(self, op: str, args: dict[str, Any], timeout: float | None = None) -> dict[str, Any]: ...


class InprocBrokerLink:
    """A :class:`BrokerLink` straight into a :class:`DeviceBroker` of this process."""

    def __init__(self, broker: B.DeviceBroker, client_id: str | None = None) -> None:
        self.broker = broker
        self.client_id = client_id or f"inproc-{uuid.uuid4().hex[:12]}"
        #: the broker's generation (see :mod:`kvstrata.devobj.broker`): reads of known keys skip the broker
        self.generation_counter = broker.generation_counter

    def call(self, op: str, args: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        return self.broker.handle(self.client_id, op, args, timeout)

    def notify(self, op: str, args: dict[str, Any]) -> None:
        """A request whose answer nobody needs (the worker link sends it one-way)."""
        self.broker.handle(self.client_id, op, args)


@dataclass(frozen=True)
class DeviceObjectConfig:
    """Client settings. ``transport``: ``auto`` (CUDA IPC on one node, NCCL across) or ``nccl``."""

    transport: str = "auto"
    # Broadcast pipeline chunk, the least: objects over 32 chunks of it get larger ones (up to 128 MiB,
    # kvstrata.devobj.chain.chunk_size). Each GPU hop of a chain of leaders ends a chunk time after the
    # one before (32 MiB is ~86 us over NVLink, ~390 GB/s). The host spends ~20-30 us per chunk (a copy
    # call, an event, polls); smaller chunks would bring that close to the chunk's GPU time.
    chunk_bytes: int = 32 << 20
    copy_threads: int = 4
    poll_seconds: float = 1.0
    node_id: str = field(default_factory=socket.gethostname)
    allow_cpu: bool = False  # CPU tensors, same-process peers only: for tests and CPU-only pipelines
    # Broadcast hops within one GPU: "kernel" (SMs) or "memcpy" (copy engine). A leader's fan-out by
    # copy engine competes with its own NVLink pull for that GPU's copy engines: 8 GiB to 3 receivers
    # on the H200 pair took 114 ms with "memcpy", 34 ms with "kernel" (one peer copy: 22 ms).
    same_gpu_copy: str = "kernel"
    # How a broadcast receiver waits for its predecessor's chunks: "host" (its copy thread polls the
    # predecessor's shared-memory counter, then queues the chunk) or "stream" (it queues every chunk at
    # once behind a GPU-side wait on that counter, cuStreamWaitValue32; needs cuda-bindings, else "host").
    broadcast_wait: str = "host"
    # Longest wait for a matched copy's GPU work; past it the receive fails (Timeout) and the object
    # goes back to the broker, instead of the receiver's thread hanging on a ready event that never fires.
    copy_timeout: float = 120.0
    # A receive (dev_subscribe / dev_mget through the broker) of at least 2x this many bytes over several
    # keys goes to the broker in growing stages (this much, then twice as much, ...): the first copies run
    # while the broker answers for the rest, instead of after one answer for all (32 x 64 MiB: ~0.8 ms of
    # round trip and replies before a ~5.5 ms copy on the H200 pair). 128 MiB is ~340 us over NVLink, longer
    # than the next stage's round trip through the worker (~250 us + ~17 us a key there). 0: one request.
    stage_bytes: int = 128 << 20

    def __post_init__(self) -> None:
        if self.transport not in ("auto", "nccl"):
            raise InvalidValue(f"transport: expected 'auto' or 'nccl', got {self.transport!r}")
        for name, least in (("chunk_bytes", 4096), ("copy_threads", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidValue(f"{name}: expected an int >= {least}, got {value!r}")
        for name in ("poll_seconds", "copy_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < FOREVER_S:
                raise InvalidValue(f"{name}: expected seconds, a finite number > 0, got {value!r}")
        if self.same_gpu_copy not in ("memcpy", "kernel"):
            raise InvalidValue(f"same_gpu_copy: expected 'memcpy' or 'kernel', got {self.same_gpu_copy!r}")
        if self.broadcast_wait not in ("host", "stream"):
            raise InvalidValue(f"broadcast_wait: expected 'host' or 'stream', got {self.broadcast_wait!r}")
        if isinstance(self.stage_bytes, bool) or not isinstance(self.stage_bytes, int) or self.stage_bytes < 0:
            raise InvalidValue(f"stage_bytes: expected an int >= 0, got {self.stage_bytes!r}")


#: broker error codes with an exception type of their own (a ServerError each: ``except ServerError`` still holds)
_SERVER_ERRORS: dict[str, type[errors.ServerError]] = {B.E_OWNER_GONE: OwnerGone, B.E_ABORTED: TransferAborted}


def error_from(code: str | None, message: str) -> Exception:
    """Map a broker error code to the exception users catch."""
    if code == B.E_NOT_FOUND:
        return errors.KeyNotFound(message)
    if code == B.E_EXISTS:
        return errors.KeyExists(message)
    if code == B.E_TIMEOUT:
        return errors.Timeout(message)
    if code in (B.E_MISMATCH, B.E_BAD_REQUEST):
        return InvalidValue(message)
    return _SERVER_ERRORS.get(code, errors.ServerError)(f"{code}: {message}" if code else message)


def check_keys(keys: Sequence[str]) -> list[str]:
    """Keys of one call: a list of distinct, non-empty strings of at most 1024 UTF-8 bytes (the KV API's limit)."""
    if isinstance(keys, str) or not isinstance(keys, Sequence):
        raise InvalidType(f"keys: expected a list of str, got {type(keys).__name__}")
    seen = set()
    out = []
    for i, k in enumerate(keys):
        if type(k) is not str:
            if not isinstance(k, str):
                raise InvalidType(f"keys[{i}]: expected a non-empty str, got {k!r}")
            k = str(k)  # a str subclass (numpy.str_): the plain str goes on the wire
        if not k:
            raise InvalidValue(f"keys[{i}]: must not be empty")
        if not (k.isascii() and len(k) <= MAX_KEY_BYTES):
            try:
                n = len(k.encode("utf-8"))
            except UnicodeEncodeError:
                raise InvalidValue(f"keys[{i}]: {k!r} is not valid Unicode (a lone surrogate)") from None
            if n > MAX_KEY_BYTES:
                raise InvalidValue(f"keys[{i}]: {n} bytes long, over the {MAX_KEY_BYTES}-byte limit")
        if k in seen:
            raise InvalidValue(f"keys: duplicate key {k!r} in one call")
        seen.add(k)
        out.append(k)
    return out


def check_tensor_lists(
    keys: Sequence[str], tensor_lists: Sequence[Sequence[torch.Tensor]], device: torch.device, *, allow_cpu: bool
) -> tuple[list[str], list[list[torch.Tensor]]]:
    """Validate one call's arguments before anything is registered or copied."""
    keys = check_keys(keys)
    if isinstance(tensor_lists, torch.Tensor) or not isinstance(tensor_lists, Sequence):
        raise InvalidType("tensor_lists: expected a list of lists of tensors")
    if len(tensor_lists) != len(keys):
        raise InvalidValue(f"tensor_lists: {len(tensor_lists)} lists for {len(keys)} keys")
    lists = []
    for i, ts in enumerate(tensor_lists):
        if isinstance(ts, torch.Tensor) or not isinstance(ts, Sequence) or not ts:
            raise InvalidType(f"tensor_lists[{i}]: expected a non-empty list of tensors")
        grads = False
        for j, t in enumerate(ts):
            # The common case in one test per tensor (a call may carry hundreds); the message only on failure.
            if (
                isinstance(t, torch.Tensor)
                and t.device == device
                and (device.type == "cuda" or (allow_cpu and device.type == "cpu"))
                and t.layout == torch.strided
                and not t.is_quantized
                and t.is_contiguous()
                and not t.requires_grad
            ):
                continue
            where = f"tensor_lists[{i}][{j}] (key {keys[i]!r})"
            if not isinstance(t, torch.Tensor):
                raise InvalidType(f"{where}: expected a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cuda" and not (allow_cpu and device.type == "cpu"):
                raise InvalidValue(
                    f"{where}: a {t.device.type} tensor; device objects live in GPU memory (expected {device})"
                )
            if t.device != device:
                raise InvalidValue(f"{where}: on {t.device}, but this client's device is {device}")
            if t.layout != torch.strided or t.is_quantized:
                kind = "quantized" if t.is_quantized else str(t.layout).removeprefix("torch.")
                raise InvalidType(f"{where}: a {kind} tensor; device objects hold dense (strided) tensors only")
            if not t.is_contiguous():
                raise InvalidValue(f"{where}: not contiguous (call .contiguous() first)")
            grads = True  # all else is fine: a tensor that requires grad (a parameter to send or to fill)
        # Parameters: their bytes, outside autograd (a copy into a leaf that requires grad would be refused)
        lists.append([t.detach() for t in ts] if grads else list(ts))
    return keys, lists


__all__ = [
    "BrokerLink",
    "DeviceObjectConfig",
    "InprocBrokerLink",
    "OwnerGone",
    "TransferAborted",
    "check_keys",
    "check_tensor_lists",
    "error_from",
]
