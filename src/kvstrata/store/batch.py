"""Batch writes with per-key results, and the write-once form used by ``mset_d2h``.

Every key of a batch gets its own result: ``None`` (done), a :class:`~kvstrata.store.Location`
(for creates) or the :class:`~kvstrata.errors.KvstrataError` that key met (``KeyExists`` for a
write-once key already present, ``CapacityError``...). One failed key never hides the others. Bad
arguments (a non-str key, a non-bytes value, a negative size) are still a ValueError/TypeError for
the whole call, raised before anything is written.

Example::

    store.put_many([("a", b"1"), ("b", b"2")], nx=True)    # write-once: [None, None]
    store.put_many([("a", b"x"), ("c", b"3")], nx=True)    # [KeyExists(...), None]; "a" unchanged

This is a mixin of :class:`~kvstrata.store.engine.ObjectStore`.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvstrata.errors import KvstrataError
from kvstrata.store.config import WriteMode
from kvstrata.store.objects import as_bytes_view, check_key, check_mode, check_ttl


class BatchMixin:
    """``put_many`` of the engine (see the module docstring; ``create_many`` / ``seal_many`` are the
    engine's own, each one critical section)."""

    def put_many(
        self,
        items: Iterable[tuple[str, object]],
        *,
        owner: object = None,
        ttl: float | None = None,
        write_mode: WriteMode | str = WriteMode.MEMORY,
        nx: bool = False,
    ) -> list[KvstrataError | None]:
        """:meth:`put` for each ``(key, value)``; per-key results. With ``nx=True``: write-once."""
        pairs = _pairs(items, "items")
        views = []
        for key, value in pairs:
            check_key(key, "items")
            views.append(as_bytes_view(value))
        self._check_batch_options(ttl, write_mode)
        out: list[KvstrataError | None] = []
        for (key, _), view in zip(pairs, views):
            try:
                self.put(key, view, owner=owner, ttl=ttl, write_mode=write_mode, nx=nx)
                out.append(None)
            except KvstrataError as exc:
                out.append(exc)
        return out

    def _check_batch_options(self, ttl: object, write_mode: object) -> None:
        check_ttl(ttl)
        if check_mode(write_mode) in (WriteMode.WRITE_THROUGH, WriteMode.WRITE_BACK) and self._disk is None:
            raise ValueError(f"write_mode: {write_mode} needs an SSD tier (StoreConfig.disk_dir)")


def _pairs(items: object, name: str) -> list[tuple]:
    if isinstance(items, str | bytes) or not isinstance(items, Iterable):
        raise ValueError(f"{name}: must be a sequence of (key, value) pairs, got {type(items).__name__}")
    pairs = list(items)
    for p in pairs:
        if not isinstance(p, tuple | list) or len(p) != 2:
            raise ValueError(f"{name}: every item must be a (key, value) pair, got {p!r:.60}")
    return pairs


__all__ = ["BatchMixin"]
