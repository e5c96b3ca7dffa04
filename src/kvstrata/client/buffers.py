"""Zero-copy views onto shared memory: :class:`WritableBuffer` (a write in progress) and :class:`ReadBuffer`."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from kvstrata.errors import ClosedError, InvalidValue


def _numpy(view: memoryview, dtype: Any, shape: Any, readonly: bool) -> np.ndarray:
    arr = np.frombuffer(view, dtype=np.dtype(dtype)) if len(view) else np.empty(0, dtype=np.dtype(dtype))
    if readonly:
        arr.flags.writeable = False
    return arr if shape is None else arr.reshape(shape)


def _tensor(view: memoryview, dtype: Any, shape: Any) -> Any:
    import torch

    dtype = dtype or torch.uint8
    if len(view) == 0:
        t = torch.empty(0, dtype=dtype)
    else:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if len(view) % itemsize:
            raise InvalidValue(f"dtype: {len(view)} bytes is not a whole number of {dtype} elements")
        t = torch.frombuffer(view, dtype=dtype)
    return t if shape is None else t.view(shape)


class WritableBuffer:
    """An object being written straight into shared memory; ``seal()`` or ``publish()`` makes it visible.

    Use as a context manager: a clean exit seals it (unless already sealed or published), an
    exception aborts it, so readers never see a half-written object::

        with client.create("weights/0", arr.nbytes) as buf:
            buf.numpy(arr.dtype, arr.shape)[:] = arr
    """

    def __init__(self, client: Any, key: str, location: Any, view: memoryview) -> None:
        self._client = client
        self.key = key
        self.size = len(view)
        self._location = location
        self._view: memoryview | None = view
        self.state = "open"
        # Dropped without seal/publish/abort: the write is aborted (on the client's next call).
        self._finalizer = weakref.finalize(self, client._defer_abort, key)

    def _live(self) -> memoryview:
        if self._view is None:
            raise ClosedError(f"buffer for {self.key!r} was already {self.state}")
        return self._view

    def memoryview(self) -> memoryview:
        """The writable bytes (valid until seal/publish/abort)."""
        return self._live()

    def numpy(self, dtype: Any = np.uint8, shape: Any = None) -> np.ndarray:
        """A writable numpy view of the bytes as ``dtype`` (reshaped to ``shape`` if given)."""
        return _numpy(self._live(), dtype, shape, readonly=False)

    def tensor(self, dtype: Any = None, shape: Any = None) -> Any:
        """A writable CPU torch view of the bytes (uint8 unless ``dtype``)."""
        return _tensor(self._live(), dtype, shape)

    def write(self, data: Any, offset: int = 0) -> None:
        """Copy ``data`` (bytes-like, array, tensor) in at ``offset``."""
        from kvstrata.client.values import byte_view

        src = byte_view(data, "data")
        view = self._live()
        if offset < 0 or offset + len(src) > len(view):
            raise InvalidValue(f"offset: {len(src)} bytes at {offset} do not fit in {len(view)}")
        view[offset : offset + len(src)] = src

    def _finish(self, action: str) -> None:
        self._live()
        self._view = None
        self._finalizer.detach()
        self.state = {"seal": "sealed", "publish": "published", "abort": "aborted"}[action]
        self._client._finish_write(action, self.key)

    def seal(self) -> None:
        """Make the object visible and immutable."""
        self._finish("seal")

    def publish(self) -> None:
        """Make the object visible but keep it mutable (a later publish or set replaces it)."""
        self._finish("publish")

    def abort(self) -> None:
        """Drop the write; the key is left as it was."""
        self._finish("abort")

    def __enter__(self) -> WritableBuffer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._view is None:
            return
        self._finish("abort" if exc_type is not None else "seal")

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"<WritableBuffer {self.key!r} {self.size} bytes {self.state}>"


class ReadBuffer:
    """A read-only zero-copy view of a stored object, holding a lease so it cannot be freed or moved.

    Release it with ``release()``, a ``with`` block, or by dropping it (garbage collection). Views
    taken from it must not be used after release.
    """

    def __init__(self, client: Any, key: str, lease_id: int, view: memoryview, tensor_view: Any = None) -> None:
        self.key = key
        self.size = len(view)
        self.lease_id = lease_id
        self._view: memoryview | None = view.toreadonly()
        self._raw = view  # writable underneath: torch has no read-only tensors
        self._client = client
        self._finalizer = weakref.finalize(self, client._defer_release, lease_id)

    def _live(self) -> memoryview:
        if self._view is None:
            raise ClosedError(f"buffer for {self.key!r} was released")
        return self._view

    @property
    def released(self) -> bool:
        return self._view is None

    def memoryview(self) -> memoryview:
        """A read-only memoryview of the object's bytes."""
        return self._live()

    def numpy(self, dtype: Any = np.uint8, shape: Any = None) -> np.ndarray:
        """A read-only numpy view as ``dtype`` (reshaped to ``shape`` if given)."""
        return _numpy(self._live(), dtype, shape, readonly=True)

    def tensor(self, dtype: Any = None, shape: Any = None) -> Any:
        """A CPU torch view (uint8 unless ``dtype``). Do not write to it: the object is shared."""
        self._live()
        return _tensor(self._raw, dtype, shape)

    def __bytes__(self) -> bytes:
        return bytes(self._live())

    def __len__(self) -> int:
        return self.size

    def release(self) -> None:
        """Give the lease back (idempotent)."""
        if self._view is None:
            return
        self._view = None
        self._raw = None  # type: ignore[assignment]
        self._finalizer.detach()
        self._client._release_leases([self.lease_id])

    def __enter__(self) -> ReadBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<ReadBuffer {self.key!r} {self.size} bytes{' released' if self._view is None else ''}>"
