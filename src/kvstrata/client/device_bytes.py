"""Device calls through a worker that shares no memory with this process (``tcp://``: another host's worker).

``mset_d2h`` / ``mget_h2d`` normally copy between the tensors and the worker's shared segments, which a TCP client
cannot map. Here each key's tensors travel as one value over the connection instead: concatenated into host
memory and sent with ``mset`` (``nx``: write-once, as the shared-memory path), or read with ``mget`` and split
back into the tensors. The stored objects are the same bytes either way, so a key written over TCP reads back
through shared memory on the worker's own host, and the other way round. The copies to and from a GPU run on
``stream`` (default: the current one) and the call returns once they are done.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from kvstrata.client import device as _device
from kvstrata.errors import InvalidValue

Result = Any  # per key: None on success, the exception in a refused key's slot


def _checked(keys: list[str], tensor_lists: Sequence[Sequence[Any]]) -> list[tuple[list[Any], int]]:
    """Each key's tensors and their total bytes (the same checks, and errors, as the shared-memory path)."""
    _device.check_outer(len(keys), tensor_lists)
    out = []
    for i, ts in enumerate(tensor_lists):
        pieces, total, _ = _device.check_key(ts, i)
        out.append(([piece[3] for piece in pieces], total))
    return out


def _on(stream: Any, tensors: list[Any]) -> Any:
    """A context running torch work on ``stream`` where the tensors are on a GPU (nothing to do otherwise)."""
    if stream is None or not any(t.is_cuda for t in tensors):
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)


def mset_d2h(client: Any, keys: list[str], tensor_lists: Sequence[Sequence[Any]], stream: Any) -> list[Result]:
    """Each key's tensors copied into one host value and stored write-once (KeyExists where the key exists)."""
    import torch

    checked = _checked(keys, tensor_lists)
    values = []
    for tensors, total in checked:
        host = torch.empty(total, dtype=torch.uint8)
        offset = 0
        with _on(stream, tensors):
            for t in tensors:
                n = t.nbytes
                if n:
                    host[offset : offset + n].copy_(t.reshape(-1).view(torch.uint8))  # (a GPU tensor: synchronous)
                offset += n
        values.append(host.numpy())
    return client.mset(list(zip(keys, values)), nx=True)


def mget_h2d(
    client: Any, keys: list[str], tensor_lists: Sequence[Sequence[Any]], timeout: float, stream: Any
) -> list[Result]:
    """Each key's value read and split into its tensors; a size that differs is an InvalidValue in its slot."""
    import torch

    checked = _checked(keys, tensor_lists)
    values = client._b().mget_views(keys, timeout) if keys else []  # (as the reply brought them: no copy)
    results: list[Result] = []
    for key, (tensors, total), value in zip(keys, checked, values):
        if isinstance(value, BaseException):
            results.append(value)
            continue
        if len(value) != total:
            results.append(
                InvalidValue(f"key {key!r}: the object holds {len(value)} bytes, its tensors {total} (no copy made)")
            )
            continue
        source = torch.frombuffer(value, dtype=torch.uint8) if total else None
        offset = 0
        with _on(stream, tensors):
            for t in tensors:
                n = t.nbytes
                if n:
                    t.view(-1).view(torch.uint8).copy_(source[offset : offset + n])
                offset += n
        cuda = next((t for t in tensors if t.is_cuda), None)
        if cuda is not None:  # (the call returns with its copies done, as the shared-memory path)
            (stream or torch.cuda.current_stream(cuda.device)).synchronize()
        results.append(None)
    return results
