"""Checkpoints and weights through kvstrata: a model's ``state_dict`` saved once, loaded by any number of processes
(this node's through its worker, or any host's in a cluster) straight into their own tensors, on a GPU or not.

The uses: weight distribution when an inference service scales out (one process saves, every new replica loads
from host memory instead of the file system), fast restarts after a crash, and checkpoints a training job hands to
its evaluators. ::

    info = save_state_dict(kv, "llama-8b@v3", model.state_dict())      # kv: any kvstrata client
    load_state_dict(kv, "llama-8b@v3", into=model)                     # elsewhere: into the model's own tensors
    weights = load_state_dict(kv, "llama-8b@v3", device="cuda:1")      # or into new tensors

Layout: the tensors' bytes, in ``state_dict`` order, are cut into objects of ``chunk_bytes`` (64 MiB): small tensors
share an object, a large one spans several. Each object is written by ``mset_d2h`` straight from the tensors (a
copy-engine batch per call on a GPU) and read by ``mget_h2d`` straight into them, with no staging copy on either
side (a non-contiguous tensor is the exception: copied through a contiguous one). Under a cluster client the
objects spread over the workers and load from all of them at once. A manifest (JSON: names, dtypes, shapes, where
each tensor's bytes lie) is written last, so a reader sees a checkpoint whole or not at all; ``overwrite=True``
publishes the new one before the old objects go, so a reader loads one version or the other, never a mix.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

import torch

from kvstrata.errors import CapacityError, InvalidType, InvalidValue, KeyExists, KeyNotFound, KvstrataError

#: the size of the objects a checkpoint is cut into (the last one of a checkpoint is smaller)
CHUNK_BYTES = 64 << 20
#: objects per ``mset_d2h`` / ``mget_h2d`` call (a call's objects are copied as one batch)
OBJECTS_PER_CALL = 16
MANIFEST_FORMAT = 1
KEY_ROOT = "ckpt"


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`save_state_dict` stored (or :func:`load_state_dict` read)."""

    name: str
    tensors: int
    nbytes: int
    objects: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _check_name(name: Any) -> str:
    if not isinstance(name, str):
        raise InvalidType(f"name: must be a str, got {type(name).__name__}")
    if not name or len(name.encode()) > 512 or any(c in name for c in "\0\n"):
        raise InvalidValue(f"name: a checkpoint's name is 1-512 bytes with no NUL or newline, got {name!r}")
    return name


def manifest_key(name: str) -> str:
    """The key of checkpoint ``name``'s manifest."""
    return f"{KEY_ROOT}/{_check_name(name)}/manifest"


def _object_key(name: str, version: str, index: int) -> str:
    return f"{KEY_ROOT}/{name}/{version}/{index}"


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 view (no copy)."""
    return tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)


def _tensors(state_dict: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(state_dict, Mapping):
        raise InvalidType(f"state_dict: must be a mapping of names to tensors, got {type(state_dict).__name__}")
    out = []
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise InvalidType(f"state_dict: names must be str, got {key!r}")
        if not isinstance(value, torch.Tensor):
            raise InvalidType(f"state_dict[{key!r}]: must be a torch.Tensor, got {type(value).__name__}")
        if value.layout is not torch.strided or value.is_quantized:
            raise InvalidType(f"state_dict[{key!r}]: a dense tensor, not {value.layout} / quantized")
        if value.device.type not in ("cpu", "cuda"):
            raise InvalidValue(f"state_dict[{key!r}]: on {value.device}, not a CPU or CUDA tensor")
        out.append((key, value.detach()))
    return out


def _plan(sizes: list[int], chunk_bytes: int) -> tuple[list[list[tuple[int, int, int]]], list[int]]:
    """Cut tensors of ``sizes`` bytes, in order, into objects of ``chunk_bytes``: per tensor its pieces
    ``(object, offset in the object, bytes)`` in the tensor's order, and each object's size."""
    pieces: list[list[tuple[int, int, int]]] = []
    objects = [0]
    for size in sizes:
        mine = []
        left = size
        while left:
            if objects[-1] == chunk_bytes:
                objects.append(0)
            take = min(left, chunk_bytes - objects[-1])
            mine.append((len(objects) - 1, objects[-1], take))
            objects[-1] += take
            left -= take
        pieces.append(mine)
    if objects[-1] == 0:
        objects.pop()
    return pieces, objects


def _per_object(flats: list[torch.Tensor], pieces: list[list[tuple[int, int, int]]], n_objects: int) -> list[list[Any]]:
    """Each object's list of tensor slices, in the order they lie in it."""
    lists: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(n_objects)]
    for flat, mine in zip(flats, pieces):
        start = 0
        for obj, offset, n in mine:
            lists[obj].append((offset, flat[start : start + n]))
            start += n
    return [[t for _, t in sorted(lst, key=lambda pair: pair[0])] for lst in lists]


def save_state_dict(
    client: Any,
    name: str,
    state_dict: Mapping[str, Any],
    *,
    overwrite: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
) -> CheckpointInfo:
    """Store ``state_dict``'s tensors (CPU or CUDA, any dtype) in kvstrata as checkpoint ``name``.

    KeyExists where a checkpoint of that name exists and not ``overwrite``. CapacityError where the store has no
    room for it all: nothing of it is left behind. Non-contiguous tensors are copied to contiguous ones first.
    """
    name = _check_name(name)
    if type(chunk_bytes) is not int or chunk_bytes < 1 << 10:
        raise InvalidValue(f"chunk_bytes: must be an int of at least 1 KiB, got {chunk_bytes!r}")
    if type(overwrite) is not bool:
        raise InvalidType(f"overwrite: must be a bool, got {type(overwrite).__name__}")
    entries = _tensors(state_dict)
    start = time.perf_counter()
    key = manifest_key(name)
    old = _read_manifest(client, name) if overwrite else None
    if not overwrite and client.exists(key):
        raise KeyExists(f"checkpoint {name!r} exists (overwrite=True replaces it)")
    contiguous = [t if t.is_contiguous() else t.contiguous() for _, t in entries]
    flats = [_flat_bytes(t) for t in contiguous]
    pieces, objects = _plan([f.numel() for f in flats], chunk_bytes)
    version = uuid.uuid4().hex[:16]
    keys = [_object_key(name, version, i) for i in range(len(objects))]
    lists = _per_object(flats, pieces, len(objects))
    written: list[str] = []
    try:
        for at in range(0, len(keys), OBJECTS_PER_CALL):
            batch = keys[at : at + OBJECTS_PER_CALL]
            results = client.mset_d2h(batch, lists[at : at + OBJECTS_PER_CALL])
            written += [k for k, r in zip(batch, results) if r is None]
            failed = next((r for r in results if r is not None), None)
            if failed is not None:
                raise failed if isinstance(failed, KvstrataError) else KvstrataError(str(failed))
        manifest = {
            "format": MANIFEST_FORMAT,
            "name": name,
            "version": version,
            "objects": objects,
            "tensors": [
                {"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "pieces": p}
                for (n, t), p in zip(entries, pieces)
            ],
        }
        client.set(key, json.dumps(manifest).encode(), nx=not overwrite)
    except BaseException as exc:
        if written:
            client.delete(written)
        if isinstance(exc, CapacityError):
            raise CapacityError(f"checkpoint {name!r} ({sum(objects)} bytes) does not fit: {exc}") from exc
        if isinstance(exc, KeyExists):
            raise KeyExists(f"checkpoint {name!r} was saved by another process meanwhile") from exc
        raise
    if old is not None and old["version"] != version:
        client.delete([_object_key(name, old["version"], i) for i in range(len(old["objects"]))])
    return CheckpointInfo(name, len(entries), sum(objects), len(objects), time.perf_counter() - start)


def _read_manifest(client: Any, name: str) -> dict[str, Any] | None:
    try:
        raw = client.get(manifest_key(name))
    except KeyNotFound:
        return None
    try:
        manifest = json.loads(raw)
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, this kvstrata reads {MANIFEST_FORMAT}")
        return manifest
    except (ValueError, AttributeError) as exc:
        raise InvalidValue(f"checkpoint {name!r}: its manifest is not one this kvstrata reads ({exc})") from exc


def checkpoint_manifest(client: Any, name: str) -> dict[str, Any]:
    """Checkpoint ``name``'s manifest: its tensors' names, dtypes and shapes, and its objects' sizes (KeyNotFound
    where there is none)."""
    manifest = _read_manifest(client, _check_name(name))
    if manifest is None:
        raise KeyNotFound(f"no checkpoint {name!r}")
    return manifest


def delete_checkpoint(client: Any, name: str) -> bool:
    """Delete checkpoint ``name`` (its manifest first: readers stop finding it); False where there was none."""
    manifest = _read_manifest(client, _check_name(name))
    if manifest is None:
        return False
    client.delete(manifest_key(name))
    client.delete([_object_key(name, manifest["version"], i) for i in range(len(manifest["objects"]))])
    return True


def load_state_dict(
    client: Any,
    name: str,
    into: Any = None,
    *,
    device: Any = "cpu",
    strict: bool = True,
    timeout: float = 0,
) -> dict[str, torch.Tensor]:
    """Load checkpoint ``name``: into ``into``'s tensors (a ``torch.nn.Module``, whose ``state_dict()`` shares its
    parameters' storage, or a mapping of names to tensors) in place, or into new tensors on ``device``.

    Returns the tensors loaded, by name. ``strict``: the checkpoint and ``into`` must name the same tensors (else
    InvalidValue listing the differences, nothing loaded); otherwise the names both have are loaded. A tensor of
    another shape or dtype is an InvalidValue naming it, with nothing loaded. ``timeout``: seconds to wait for the
    checkpoint to appear (0: KeyNotFound at once). A checkpoint whose objects are gone (deleted meanwhile, or
    evicted) raises KeyNotFound naming it.
    """
    name = _check_name(name)
    if timeout:
        try:
            client.get(manifest_key(name), timeout=timeout)
        except KeyNotFound:
            pass
    manifest = _read_manifest(client, name)
    if manifest is None:
        raise KeyNotFound(f"no checkpoint {name!r}")
    entries = manifest["tensors"]
    targets = _targets(into, entries, device, strict, name)
    chosen = [e for e in entries if e["name"] in targets]
    outs = {e["name"]: targets[e["name"]] for e in chosen}
    # (a non-contiguous target is loaded through a contiguous copy)
    staged = {
        n: t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device) for n, t in outs.items()
    }
    flats = [_flat_bytes(staged[e["name"]]) for e in chosen]
    objects: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for flat, entry in zip(flats, chosen):
        at = 0
        for obj, offset, n in entry["pieces"]:
            objects.setdefault(obj, []).append((offset, flat[at : at + n]))
            at += n
    version = manifest["version"]
    for obj, slices in objects.items():  # (a non-strict load may need part of an object: the rest goes to a scratch)
        slices.sort(key=lambda pair: pair[0])
        filled, padded = 0, []
        for offset, view in slices:
            if offset > filled:
                padded.append(torch.empty(offset - filled, dtype=torch.uint8, device=view.device))
            padded.append(view)
            filled = offset + view.numel()
        size = manifest["objects"][obj]
        if filled < size:
            padded.append(torch.empty(size - filled, dtype=torch.uint8, device=padded[-1].device))
        objects[obj] = padded  # type: ignore[assignment]
    order = sorted(objects)
    for at in range(0, len(order), OBJECTS_PER_CALL):
        batch = order[at : at + OBJECTS_PER_CALL]
        results = client.mget_h2d([_object_key(name, version, i) for i in batch], [objects[i] for i in batch])
        for i, r in zip(batch, results):
            if isinstance(r, KeyNotFound):
                raise KeyNotFound(f"checkpoint {name!r} is incomplete: object {i} is gone (deleted or evicted)")
            if r is not None:
                raise r
    for n, t in outs.items():
        if staged[n] is not t:
            t.copy_(staged[n])
    return outs


def _targets(into: Any, entries: list[dict], device: Any, strict: bool, name: str) -> dict[str, torch.Tensor]:
    """The tensors to load into, by name, checked against the manifest's entries."""
    if into is None:
        dev = torch.device(device)
        return {e["name"]: torch.empty(e["shape"], dtype=_dtype(e["dtype"]), device=dev) for e in entries}
    if isinstance(into, torch.nn.Module):
        into = into.state_dict(keep_vars=False)
    if not isinstance(into, Mapping):
        raise InvalidType(f"into: a torch.nn.Module or a mapping of names to tensors, got {type(into).__name__}")
    held = {e["name"] for e in entries}
    given = set(into)
    if strict and held != given:
        parts = []
        for what, names in (("not in the checkpoint", sorted(given - held)), ("only in it", sorted(held - given))):
            if names:
                parts.append(
                    f"{what}: {', '.join(names[:10])}" + (f" and {len(names) - 10} more" if len(names) > 10 else "")
                )
        raise InvalidValue(
            f"checkpoint {name!r} and into= name different tensors ({'; '.join(parts)}); strict=False loads the "
            "names both have"
        )
    out = {}
    for e in entries:
        if e["name"] not in into:
            continue
        t = into[e["name"]]
        if not isinstance(t, torch.Tensor):
            raise InvalidType(f"into[{e['name']!r}]: must be a torch.Tensor, got {type(t).__name__}")
        want = (list(e["shape"]), _dtype(e["dtype"]))
        if (list(t.shape), t.dtype) != want:
            raise InvalidValue(
                f"into[{e['name']!r}]: {tuple(t.shape)} {t.dtype}, the checkpoint holds {tuple(want[0])} {want[1]}"
            )
        out[e["name"]] = t
    return out


def _dtype(text: str) -> torch.dtype:
    dtype = getattr(torch, text, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidValue(f"checkpoint names a dtype this torch lacks: {text!r}")
    return dtype
