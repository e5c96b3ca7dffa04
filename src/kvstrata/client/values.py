"""Turning user values into flat byte views without copying: bytes-like, numpy arrays, CPU tensors."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstrata.errors import InvalidType, InvalidValue


def byte_view(value: Any, name: str = "value") -> memoryview:
    """A 1-D unsigned-byte memoryview over ``value``'s raw bytes (no copy).

    Accepts bytes-like objects, C-contiguous numpy arrays and contiguous CPU torch tensors (their raw
    bytes; the dtype and shape are the caller's to remember). TypeError/ValueError naming ``name``.
    """
    if isinstance(value, bytes | bytearray):
        return memoryview(value)
    if isinstance(value, str):
        raise InvalidType(f"{name}: str is not bytes; encode it first (value.encode())")
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise InvalidType(f"{name}: numpy arrays of Python objects have no raw bytes to store")
        if not value.flags.c_contiguous:
            raise InvalidValue(f"{name}: numpy array must be C-contiguous (use np.ascontiguousarray)")
        return memoryview(value.reshape(-1).view(np.uint8))
    torch = _torch_if_tensor(value)
    if torch is not None:
        try:
            return memoryview(tensor_bytes(value, name).numpy())
        except RuntimeError as exc:  # a lazy view (conjugate, negative bit), a nested tensor...: no plain bytes
            why = f"{name}: this tensor has no plain raw bytes to store ({exc}); .clone() it first"
            raise InvalidValue(why) from exc
    try:
        view = memoryview(value)
    except TypeError:
        raise InvalidType(
            f"{name}: expected bytes-like, a numpy array or a CPU torch tensor, got {type(value).__name__}"
        ) from None
    except ValueError as exc:  # a released memoryview, say
        raise InvalidValue(f"{name}: {exc}") from None
    if not view.c_contiguous:
        raise InvalidValue(f"{name}: buffer must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def tensor_bytes(t: Any, name: str = "tensor", *, device_ok: bool = False) -> Any:
    """A flat uint8 tensor viewing ``t``'s bytes (no copy); ``t`` must be contiguous."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise InvalidType(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" and not device_ok:
        raise InvalidType(f"{name}: a {t.device} tensor; store device tensors with mset_d2h, or .cpu() it first")
    if not t.is_contiguous():
        raise InvalidValue(f"{name}: tensor must be contiguous (call .contiguous() first)")
    if t.is_sparse or t.is_quantized:
        raise InvalidType(f"{name}: sparse and quantized tensors have no flat raw bytes")
    flat = t.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _torch_if_tensor(value: Any) -> Any:
    mod = type(value).__module__
    if not mod.startswith("torch"):
        return None
    import torch

    return torch if isinstance(value, torch.Tensor) else None
