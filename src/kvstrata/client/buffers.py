"""Zero-copy views onto shared memory: :class:`WritableBuffer` (a write in progress) and :class:`ReadBuffer`."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from kvstrata.errors import ClosedError, ConnectionLost, InvalidType, InvalidValue


def _numpy(view: memoryview, dtype: Any, shape: Any, readonly: bool) -> np.ndarray:
    try:
        dtype = np.dtype(dtype)
    except TypeError as exc:
        raise InvalidType(f"dtype: {dtype!r} is not a numpy dtype") from exc
    if len(view) % max(dtype.itemsize, 1):
        raise InvalidValue(f"dtype: {len(view)} bytes is not a whole number of {dtype} elements")
    arr = np.frombuffer(view, dtype=dtype) if len(view) else np.empty(0, dtype=dtype)
    if readonly:
        arr.flags.writeable = False
    if shape is None:
        return arr
    try:
        return arr.reshape(shape)
    except (TypeError, ValueError) as exc:
        raise InvalidValue(f"shape: {shape!r} does not fit {arr.size} elements of {dtype}") from exc


def _tensor(view: memoryview, dtype: Any, shape: Any) -> Any:
    import torch

    dtype = dtype or torch.uint8
    if not isinstance(dtype, torch.dtype):
        raise InvalidType(f"dtype: {dtype!r} is not a torch dtype")
    if len(view) == 0:
        t = torch.empty(0, dtype=dtype)
    else:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if len(view) % itemsize:
            raise InvalidValue(f"dtype: {len(view)} bytes is not a whole number of {dtype} elements")
        t = torch.frombuffer(view, dtype=dtype)
    if shape is None:
        return t
    try:
        return t.view(shape)
    except (TypeError, RuntimeError) as exc:
        raise InvalidValue(f"shape: {shape!r} does not fit {t.numel()} elements of {dtype}") from exc


class WritableBuffer:
    """An object being written straight into shared memory; ``seal()`` or ``publish()`` makes it visible.

    Use as a context manager: a clean exit seals it (unless already sealed or published), an
    exception aborts it, so readers never see a half-written object::

        with client.create("weights/0", arr.nbytes) as buf:
            buf.numpy(arr.dtype, arr.shape)[:] = arr

    The bytes start out as whatever the memory last held (as ``numpy.empty``): write every one before
    sealing. Views taken from the buffer (its memoryview, numpy arrays, tensors) write straight into the
    store, so drop them at ``seal()`` / ``publish()`` / ``abort()``: after a seal they would change an
    object others read as immutable, after an abort memory the store gives to other objects.
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
        # The write ends with its client's close, or its connection (the worker aborts a lost client's writes): the
        # bytes may be another object's by now, so nothing more goes into them
        if self._client._closed:
            raise ClosedError(f"buffer for {self.key!r}: its client is closed, which aborted the write")
        lost = self._client._backend.connection_lost()
        if lost:
            raise ConnectionLost(f"buffer for {self.key!r}: {lost}; the worker aborted the write")
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
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
            raise InvalidType(f"offset: an int, not {type(offset).__name__}")
        offset = int(offset)
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
    """A read-only zero-copy view of a stored object, holding a lease so it cannot be freed or moved (``lease_id``
    None: a value a worker sent over TCP, in this process's memory, with no lease to hold).

    Release it with ``release()``, a ``with`` block, or by dropping it (garbage collection). Closing the
    client releases it too (its methods then raise ``ClosedError``). Views taken from it must not be used
    after either: the memory goes back to the store. Its memoryview and numpy arrays are read-only; torch
    has no read-only tensors, so :meth:`tensor` must be treated as one (an in-place op on it would change
    the object under every reader).
    """

    def __init__(self, client: Any, key: str, lease_id: int | None, view: memoryview, tensor_view: Any = None) -> None:
        self.key = key
        self.size = len(view)
        self.lease_id = lease_id
        self._view: memoryview | None = view.toreadonly()
        self._raw = view  # writable underneath: torch has no read-only tensors
        self._client = client
        self._finalizer = None if lease_id is None else weakref.finalize(self, client._defer_release, lease_id)

    def _live(self) -> memoryview:
        if self._view is None:
            raise ClosedError(f"buffer for {self.key!r} was released")
        if self._client._closed:  # its lease went back with the client's others: the bytes may be another's now
            raise ClosedError(f"buffer for {self.key!r}: its client is closed")
        return self._view

    @property
    def released(self) -> bool:
        return self._view is None or self._client._closed

    def memoryview(self) -> memoryview:
        """A read-only memoryview of the object's bytes."""
        return self._live()

    def numpy(self, dtype: Any = np.uint8, shape: Any = None) -> np.ndarray:
        """A read-only numpy view as ``dtype`` (reshaped to ``shape`` if given)."""
        return _numpy(self._live(), dtype, shape, readonly=True)

    def tensor(self, dtype: Any = None, shape: Any = None) -> Any:
        """A CPU torch view (uint8 unless ``dtype``, reshaped to ``shape`` if given). Never write to it: the object
        is shared, and torch cannot mark a tensor read-only."""
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
        if self._finalizer is not None:
            self._finalizer.detach()
            self._client._release_leases([self.lease_id])

    def __enter__(self) -> ReadBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<ReadBuffer {self.key!r} {self.size} bytes{' released' if self._view is None else ''}>"
