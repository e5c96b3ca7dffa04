"""Prefix reuse of a paged KV cache through kvstrata: the offload path of an inference engine.

An engine that pages its KV cache (vLLM's ``[2, num_blocks, block_size, heads, head_dim]`` per layer, an SGLang
token pool, an MLA model's latent cache) hands :class:`PrefixKVCache` its cache once. Per request it then asks
how much of the prompt's KV kvstrata holds, loads that prefix straight into its own blocks, computes the rest and
offloads the full blocks kvstrata lacks::

    cache = PrefixKVCache(kv, kv_caches, model="llama-3-8b")   # kv: a kvstrata Client (embedded or a worker's)
    n = cache.lookup(tokens)                       # leading full blocks kvstrata holds
    n = cache.load(tokens, block_ids[:n])          # copied into those blocks of the engine's cache
    ... compute the KV of tokens[n * cache.block_tokens:] into block_ids[n:] ...
    cache.save(tokens, block_ids)                  # offload the full blocks kvstrata does not hold yet

A block's key is a hash chain over its tokens and every token before it (as vLLM's prefix caching keys them),
under a prefix naming the model and the cache's geometry (layout, segments, bytes, dtype, tokens per block): equal
prefixes of one model give equal keys, and a cache of another shape never reads them. ``salt`` (a LoRA adapter's
name, the hashes of a request's images) keeps requests whose KV differs for the same tokens apart.

Each block's bytes go between the engine's cache and kvstrata's shared host memory with no staging copy:
``mget_h2d`` / ``mset_d2h`` copy every layer's K and V of the block from or to its place in the paged cache (one
copy-engine batch per call on a GPU, a ``memcpy`` per piece on CPU). Through a worker, the same keys serve every
process of the node: a prefill process saves, a decode process loads (prefill-to-decode hand-off), and blocks
past the host tier's room spill to its SSD tier.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvstrata.errors import CapacityError, InvalidType, InvalidValue, KeyExists, KeyNotFound
from kvstrata.ops.block_pack import pack_blocks, unpack_blocks
from kvstrata.ops.kv_layout import KVLayout

log = logging.getLogger(__name__)

#: device memory a load or save packs blocks in at a time, by default where the KV cache is on a GPU (a block's
#: pieces, 64 of 32 KiB for Llama-3-8B, go to the copy engine as one DMA: 7.8 GB/s unpacked, ~line rate packed)
STAGING_BYTES = 64 << 20

#: the longest key prefix (model name and geometry) accepted: the worker takes keys of up to 1,024 bytes, and each
#: block's key adds a '/' and 32 hex digits
MAX_PREFIX_BYTES = 1024 - 33


@dataclasses.dataclass
class SaveResult:
    """What a :meth:`PrefixKVCache.save` did with the blocks it was given."""

    stored: int = 0  # offloaded by this call
    present: int = 0  # held by kvstrata already (looked up first, or written by another process meanwhile)
    refused: int = 0  # no room in kvstrata's tiers: not offloaded (computed again when next needed)
    stored_bytes: int = 0


@dataclasses.dataclass
class PrefixCacheStats:
    """Running totals of one :class:`PrefixKVCache` (read them off :attr:`PrefixKVCache.stats`)."""

    lookups: int = 0
    lookup_blocks: int = 0  # full blocks the lookups were asked about
    hit_blocks: int = 0  # of them, in the cached prefixes found
    loaded_blocks: int = 0
    load_misses: int = 0  # blocks a load was asked for that could not be read (gone since the lookup, say)
    stored_blocks: int = 0
    present_blocks: int = 0
    refused_blocks: int = 0


class PrefixKVCache:
    """Offload a paged KV cache's full blocks to kvstrata and load cached prefixes back, keyed by tokens.

    ``client``: a :class:`kvstrata.Client` (``kvstrata.connect(...)``). ``kv_caches``: the engine's paged cache,
    either vLLM's list of per-layer ``[2, num_blocks, block_size, heads, head_dim]`` tensors (``block_tokens``
    read off it) or a :class:`~kvstrata.ops.KVLayout` (``KVLayout.from_sglang``, ``KVLayout.from_mla``), which
    needs ``block_tokens``. ``model``: names the model whose KV this is (its weights: two fine-tunes must not share
    keys). The cache's tensors may live on a GPU or on CPU; they are read and written in place.

    ``staging_bytes``: on a GPU, blocks are packed (:func:`kvstrata.ops.block_pack.pack_blocks`, at device-memory
    speed) into a buffer of up to that many bytes (default :data:`STAGING_BYTES`), so that each block crosses the link
    as one DMA, not one per layer and K/V; 0 copies every piece in place. The stored format is the same both ways.

    Thread-safe as far as the client is; the totals in :attr:`stats` are kept under a lock.
    """

    def __init__(
        self,
        client: Any,
        kv_caches: Sequence[torch.Tensor] | KVLayout,
        *,
        model: str,
        block_tokens: int | None = None,
        namespace: str = "kv",
        staging_bytes: int | None = None,
    ) -> None:
        if isinstance(kv_caches, KVLayout):
            layout = kv_caches
            if block_tokens is None:
                raise InvalidValue("block_tokens: needed with a KVLayout (tokens per block of the cache)")
        else:
            if isinstance(kv_caches, torch.Tensor):
                raise InvalidType(
                    "kv_caches: a list of per-layer tensors or a KVLayout, not one tensor (wrap it in a list)"
                )
            layout = KVLayout.from_vllm(kv_caches)
            tokens_here = layout.tensors[0].shape[2]
            if block_tokens is not None and block_tokens != tokens_here:
                raise InvalidValue(
                    f"block_tokens: {block_tokens}, but the cache's blocks hold {tokens_here} tokens (dim 2)"
                )
            block_tokens = tokens_here
        if type(block_tokens) is not int or block_tokens < 1:
            raise InvalidValue(f"block_tokens: must be an int >= 1, got {block_tokens!r}")
        for name, text in (("model", model), ("namespace", namespace)):
            if not isinstance(text, str) or not text:
                raise InvalidValue(f"{name}: must be a non-empty str, got {text!r}")
        self.client = client
        self.layout = layout
        self.block_tokens = block_tokens
        self.block_bytes = layout.block_bytes
        dtype = str(layout.dtype).removeprefix("torch.")
        geometry = f"{layout.kind}.{layout.num_segments}x{layout.chunk_bytes}.{dtype}.{block_tokens}t"
        self.key_prefix = f"{namespace}/{model}/{geometry}"
        try:
            prefix_bytes = len(self.key_prefix.encode())
        except UnicodeEncodeError:
            raise InvalidValue("model / namespace: not encodable as UTF-8 (lone surrogate?)") from None
        if prefix_bytes > MAX_PREFIX_BYTES:
            raise InvalidValue(f"model: the key prefix {self.key_prefix[:60]!r}... is over {MAX_PREFIX_BYTES} bytes")
        if staging_bytes is None:
            staging_bytes = STAGING_BYTES if layout.device.type == "cuda" else 0
        if type(staging_bytes) is not int or staging_bytes < 0:
            raise InvalidValue(f"staging_bytes: must be an int >= 0, got {staging_bytes!r}")
        #: blocks packed per copy call (0: every piece copied in place, no packing)
        self.staging_blocks = max(1, staging_bytes // self.block_bytes) if staging_bytes else 0
        self.stats = PrefixCacheStats()
        self._stats_lock = threading.Lock()
        self._side: Any = None  # (a CUDA stream, made at the first packed load)

    # -- keys --------------------------------------------------------------------------------------
    def block_keys(self, tokens: Any, salt: str | bytes | None = None) -> list[str]:
        """The key of each full block of ``tokens`` (a 1-D sequence of token ids: list, numpy array or CPU
        tensor), each hashing its tokens and all before it. A trailing partial block has none."""
        ids = _token_ids(tokens)
        bt = self.block_tokens
        if salt is None:
            parent = b""
        elif isinstance(salt, (str, bytes)):
            parent = hashlib.blake2b(salt.encode() if isinstance(salt, str) else salt, digest_size=16).digest()
        else:
            raise InvalidType(f"salt: must be a str, bytes or None, got {type(salt).__name__}")
        raw = ids.tobytes()
        step = bt * 8
        keys = []
        prefix = self.key_prefix
        for start in range(0, (len(ids) // bt) * step, step):
            h = hashlib.blake2b(parent, digest_size=16)
            h.update(raw[start : start + step])
            parent = h.digest()
            keys.append(f"{prefix}/{h.hexdigest()}")
        return keys

    # -- the three steps of a request ----------------------------------------------------------------
    def lookup(self, tokens: Any, salt: str | bytes | None = None) -> int:
        """How many leading full blocks of ``tokens`` kvstrata holds (one request; their KV is
        ``tokens[: n * block_tokens]``). A block held after a missing one does not count: only a prefix is
        reusable."""
        keys = self.block_keys(tokens, salt)
        present = self.client.exists(keys) if keys else []
        n = next((i for i, p in enumerate(present) if not p), len(keys))
        with self._stats_lock:
            self.stats.lookups += 1
            self.stats.lookup_blocks += len(keys)
            self.stats.hit_blocks += n
        return n

    def load(
        self, tokens: Any, block_ids: Sequence[int], salt: str | bytes | None = None, *, stream: Any = None
    ) -> int:
        """Copy the KV of the first ``len(block_ids)`` full blocks of ``tokens`` from kvstrata into the engine's
        blocks ``block_ids`` (block ``i`` of the prompt into ``block_ids[i]``); returns how many leading blocks
        were loaded. A block that cannot be read (evicted since the lookup, say) ends the prefix: the engine
        computes from there (blocks after it may have been written too, and are to be overwritten). On a GPU
        the copies run on a copy stream ordered after ``stream`` (default: the current one); when this returns
        the bytes have crossed the link, and where blocks are packed their unpacking is queued on ``stream``
        (ordered before the model's next kernels there)."""
        keys = self.block_keys(tokens, salt)
        ids = self._check_blocks(block_ids, len(keys), "load", distinct=True)
        if not ids:
            return 0
        keys = keys[: len(ids)]
        if not self.staging_blocks:
            results = self.client.mget_h2d(keys, self._block_tensors(ids), stream=stream)
        else:
            results = self._load_packed(keys, ids, stream)
        n = next((i for i, r in enumerate(results) if r is not None), len(results))
        if n < len(results):
            first = results[n]
            if not isinstance(first, KeyNotFound):  # a key of ours holding something else: worth a line
                log.warning("prefix cache: block %d of %s could not be loaded: %s", n, keys[n], first)
        with self._stats_lock:
            self.stats.loaded_blocks += n
            self.stats.load_misses += len(ids) - n
        return n

    def _load_packed(self, keys: list[str], ids: list[int], stream: Any) -> list[Any]:
        """Load chunk by chunk into packed buffers, each chunk's leading loaded blocks unpacked into the cache; stops
        at the first block not loaded (the rest count as not loaded). Two buffers take turns: a chunk's copies
        cross the link while the one before is unpacked and the next is asked for (an async call, its copies
        ordered after that buffer's last unpack through a side stream, not after everything on ``stream``)."""
        stream = self._stream(stream)
        chunks = self._chunks(len(ids))
        bufs = [self._buffer(chunks[0][1] - chunks[0][0], stream) for _ in range(min(2, len(chunks)))]
        side = self._side_stream()
        freed: list[Any] = [None, None]  # per buffer: the event after its last unpack
        futures: list[concurrent.futures.Future] = []

        def ask(k: int) -> None:
            lo, hi = chunks[k]
            buf = bufs[k % 2]
            if side is not None and freed[k % 2] is not None:
                side.wait_event(freed[k % 2])
            rows = [[r] for r in buf[: hi - lo].unbind(0)]
            futures.append(self.client.async_mget_h2d(keys[lo:hi], rows, stream=side))

        results: list[Any] = []
        try:
            for k in range(min(2, len(chunks))):
                ask(k)
            for k, (lo, _) in enumerate(chunks):
                got = futures[k].result()
                m = next((i for i, r in enumerate(got) if r is not None), len(got))
                if m:
                    with self._on(stream):
                        unpack_blocks(self.layout, ids[lo : lo + m], bufs[k % 2])
                        if stream is not None:
                            freed[k % 2] = stream.record_event()
                results += got
                if m < len(got):
                    break
                if k + 2 < len(chunks):
                    ask(k + 2)
        finally:
            concurrent.futures.wait(futures)  # (copies still landing in the buffers: never freed under them)
        return results + [KeyNotFound("not loaded: an earlier block was not")] * (len(ids) - len(results))

    def _save_packed(self, keys: list[str], ids: list[int], stream: Any) -> list[Any]:
        """Pack chunk by chunk into one buffer, each chunk stored by one ``mset_d2h`` (its copies wait for the
        packing on ``stream``; the next packing waits for the call, whose copies have landed when it returns).
        Packing takes ~0.1 ms a 64 MiB chunk on the H200: against that, two buffers handed to async calls measured
        no faster (0.43 of the DMA ceiling at 128 blocks in one call, against 0.70 in this way in another; the
        async calls add two thread hand-offs a chunk)."""
        stream = self._stream(stream)
        rows = min(self.staging_blocks, len(ids))
        buf = self._buffer(rows, stream)
        outcomes: list[Any] = []
        for lo in range(0, len(ids), rows):
            chunk = ids[lo : lo + rows]
            with self._on(stream):
                pack_blocks(self.layout, chunk, buf)
            outcomes += self._mset(keys[lo : lo + rows], [[r] for r in buf[: len(chunk)].unbind(0)], stream)
        return outcomes

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        """``(lo, hi)`` of each chunk of ``n`` blocks: all in one where they fit the staging room, else in halves of
        it (two buffers take turns)."""
        rows = self.staging_blocks if n <= self.staging_blocks else max(1, self.staging_blocks // 2)
        return [(lo, min(lo + rows, n)) for lo in range(0, n, rows)]

    def _side_stream(self) -> Any:
        """This cache's stream for the loads' copies to wait on (None on CPU)."""
        if self.layout.device.type != "cuda":
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(self.layout.device)
        return self._side

    def save(
        self,
        tokens: Any,
        block_ids: Sequence[int],
        salt: str | bytes | None = None,
        *,
        start: int = 0,
        stream: Any = None,
    ) -> SaveResult:
        """Offload the full blocks of ``tokens`` that kvstrata does not hold yet, from the engine's blocks
        ``block_ids`` (block ``i`` of the prompt in ``block_ids[i]``; as many ids as the engine has full blocks
        of the prompt, at most). Blocks before ``start`` are skipped unlooked at (the prefix just loaded); the
        others are looked up first, so those held already cost no copy. Where the store has no room a block is
        counted as refused, not raised: serving goes on. On a GPU the copies wait for ``stream`` (default: the
        current one) and have landed when this returns."""
        keys, todo, ids, result = self._plan_save(tokens, block_ids, salt, start)
        if not todo:
            return result
        todo_keys, todo_ids = [keys[i] for i in todo], [ids[i] for i in todo]
        if not self.staging_blocks:
            outcomes = self._mset(todo_keys, self._block_tensors(todo_ids), stream)
        else:
            outcomes = self._save_packed(todo_keys, todo_ids, stream)
        self._count_saved(outcomes, result)
        return result

    def _mset(self, keys: list[str], tensor_lists: list[list[torch.Tensor]], stream: Any) -> list[Any]:
        try:
            return self.client.mset_d2h(keys, tensor_lists, stream=stream)
        except CapacityError as exc:  # the call as a whole found no room: none of it stored
            return [exc] * len(keys)

    def save_async(
        self,
        tokens: Any,
        block_ids: Sequence[int],
        salt: str | bytes | None = None,
        *,
        start: int = 0,
        stream: Any = None,
    ) -> concurrent.futures.Future:
        """:meth:`save` with its copies in the background: the lookup is done when this returns, the Future's
        result is the :class:`SaveResult`. The blocks must keep their KV (not be reused by the engine) until the
        Future is done; the model's next kernels on ``stream`` need not wait for it."""
        keys, todo, ids, result = self._plan_save(tokens, block_ids, salt, start)
        done: concurrent.futures.Future = concurrent.futures.Future()
        if not todo:
            done.set_result(result)
            return done
        todo_ids = [ids[i] for i in todo]
        if not self.staging_blocks:
            tensor_lists = self._block_tensors(todo_ids)
        else:  # a buffer of its own, held until the copies are done (freed with the callback's closure)
            stream = self._stream(stream)
            buf = self._buffer(len(todo), stream)
            with self._on(stream):
                pack_blocks(self.layout, todo_ids, buf)
            tensor_lists = [[r] for r in buf.unbind(0)]
        inner = self.client.async_mset_d2h([keys[i] for i in todo], tensor_lists, stream=stream)

        def settle(f: concurrent.futures.Future) -> None:
            del tensor_lists[:]  # (held until here: a packed buffer must outlive the copies out of it)
            try:
                outcomes = f.result()
            except CapacityError as exc:
                outcomes = [exc] * len(todo)
            except BaseException as exc:  # (handed to the caller's Future)
                done.set_exception(exc)
                return
            try:
                self._count_saved(outcomes, result)
            except BaseException as exc:  # (an unexpected per-key error, handed on)
                done.set_exception(exc)
                return
            done.set_result(result)

        inner.add_done_callback(settle)
        return done

    # -- helpers -------------------------------------------------------------------------------------
    def _plan_save(
        self, tokens: Any, block_ids: Sequence[int], salt: str | bytes | None, start: int
    ) -> tuple[list[str], list[int], list[int], SaveResult]:
        keys = self.block_keys(tokens, salt)
        ids = self._check_blocks(block_ids, len(keys), "save", distinct=False)
        if type(start) is not int or not 0 <= start <= len(ids):
            raise InvalidValue(f"start: must be an int from 0 to the {len(ids)} blocks given, got {start!r}")
        keys = keys[: len(ids)]
        present = self.client.exists(keys[start:]) if start < len(keys) else []
        todo = [start + i for i, p in enumerate(present) if not p]
        result = SaveResult(present=len(present) - len(todo))
        return keys, todo, ids, result

    def _count_saved(self, outcomes: list[Any], result: SaveResult) -> None:
        for r in outcomes:
            if r is None:
                result.stored += 1
            elif isinstance(r, KeyExists):  # written by another process since the lookup
                result.present += 1
            elif isinstance(r, CapacityError):
                result.refused += 1
            else:
                raise r
        result.stored_bytes = result.stored * self.block_bytes
        with self._stats_lock:
            self.stats.stored_blocks += result.stored
            self.stats.present_blocks += result.present
            self.stats.refused_blocks += result.refused

    def _check_blocks(self, block_ids: Sequence[int], full_blocks: int, op: str, *, distinct: bool) -> list[int]:
        if isinstance(block_ids, torch.Tensor):
            if block_ids.dim() != 1 or block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
                raise InvalidValue(
                    f"block_ids: a 1-D integer tensor or sequence, got {block_ids.dtype} {tuple(block_ids.shape)}"
                )
            ids = block_ids.tolist()
        elif isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Sequence | np.ndarray):
            raise InvalidType(f"block_ids: a sequence of block indices, got {type(block_ids).__name__}")
        else:
            ids = list(block_ids)
        nblocks = self.layout.num_blocks
        for i, b in enumerate(ids):
            if isinstance(b, np.integer):
                b = ids[i] = int(b)
            if type(b) is not int:
                raise InvalidType(f"block_ids[{i}]: must be an int, got {type(b).__name__}")
            if not 0 <= b < nblocks:
                raise InvalidValue(f"block_ids[{i}]: {b} is outside the cache's {nblocks} blocks")
        if len(ids) > full_blocks:
            raise InvalidValue(
                f"block_ids: {len(ids)} blocks to {op}, but the tokens fill {full_blocks} full blocks of "
                f"{self.block_tokens} (a partial block is not offloaded)"
            )
        if distinct and len(set(ids)) != len(ids):
            dup = next(b for i, b in enumerate(ids) if b in ids[:i])
            raise InvalidValue(f"block_ids: block {dup} named twice (two prompt blocks cannot load into one)")
        return ids

    def _stream(self, stream: Any) -> Any:
        """The stream the packing runs on: ``stream``, else the current one of the cache's device (None on CPU)."""
        if stream is not None or self.layout.device.type != "cuda":
            return stream
        return torch.cuda.current_stream(self.layout.device)

    def _on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _buffer(self, rows: int, stream: Any) -> torch.Tensor:
        """A packed buffer of ``rows`` blocks on the cache's device, from torch's caching allocator on ``stream``:
        the stream the (un)packing runs on, so that the block is not handed out again, once let go, before the
        kernels queued there that use it have run."""
        with self._on(stream):
            return torch.empty((rows, self.block_bytes), dtype=torch.uint8, device=self.layout.device)

    def _block_tensors(self, ids: list[int]) -> list[list[torch.Tensor]]:
        """Each block's pieces: every layer's K and V chunk, in place in the engine's cache (uint8 views)."""
        views = self.layout.seg_views
        return [[v[b] for v in views] for b in ids]


def _token_ids(tokens: Any) -> np.ndarray:
    """``tokens`` as a 1-D int64 numpy array, or a clear error."""
    if isinstance(tokens, torch.Tensor):
        if tokens.device.type != "cpu":
            raise InvalidValue(f"tokens: must be on the CPU (token ids are hashed on the host), got {tokens.device}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise InvalidValue(f"tokens: must hold integer token ids, got {tokens.dtype}")
        arr = tokens.detach().numpy()
    elif isinstance(tokens, (str, bytes)):
        raise InvalidType(f"tokens: token ids (a sequence of ints), not {type(tokens).__name__}")
    else:
        try:
            arr = np.asarray(tokens)
        except (TypeError, ValueError) as exc:
            raise InvalidType(f"tokens: not a sequence of token ids ({exc})") from None
        if arr.size and arr.dtype.kind not in "iu":
            raise InvalidValue(f"tokens: must hold integer token ids, got {arr.dtype}")
    if arr.ndim != 1:
        raise InvalidValue(f"tokens: must be 1-D, got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.int64)


__all__ = ["PrefixCacheStats", "PrefixKVCache", "SaveResult"]
