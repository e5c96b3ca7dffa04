"""save_state_dict / load_state_dict: a model's weights through kvstrata, embedded and through a worker, bit for
bit across dtypes and object boundaries; into a module, a mapping or new tensors; overwrite, delete, and every
refusal named with nothing left half-done."""

from __future__ import annotations

import threading

import pytest
import torch

import kvstrata
from kv_helpers import worker_fixtures
from kvstrata.errors import CapacityError, InvalidType, InvalidValue, KeyExists, KeyNotFound
from kvstrata.integrations import (
    checkpoint_manifest,
    delete_checkpoint,
    load_state_dict,
    save_state_dict,
)
from kvstrata.integrations.checkpoint import _object_key

worker, kv = worker_fixtures("ckpt-worker", memory=32 << 20, segment=8 << 20)
CHUNK = 4096  # small objects: tensors span several, small ones share one


class Tiny(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(50, 24)
        self.proj = torch.nn.Linear(24, 40, bias=True)
        self.norm = torch.nn.LayerNorm(40)
        self.h16 = torch.nn.Parameter(torch.randn(7, 9).half())
        self.bf = torch.nn.Parameter(torch.randn(33).bfloat16())
        self.register_buffer("steps", torch.arange(5, dtype=torch.int64) * seed)
        self.register_buffer("mask", torch.rand(11) > 0.5)
        self.register_buffer("empty", torch.zeros(0, 3))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k].cpu(), b[k].cpu()) for k in a
    )


def test_a_model_loads_bit_for_bit_into_another_model(kv):
    src, dst = Tiny(1), Tiny(2)
    info = save_state_dict(kv, "tiny@1", src.state_dict(), chunk_bytes=CHUNK)
    total = sum(t.nbytes for t in src.state_dict().values())
    assert (info.tensors, info.nbytes) == (len(src.state_dict()), total)
    assert info.objects == -(-total // CHUNK) > 2
    assert not same(src.state_dict(), dst.state_dict())
    loaded = load_state_dict(kv, "tiny@1", into=dst)
    assert same(src.state_dict(), dst.state_dict())
    assert loaded["proj.weight"].data_ptr() == dst.proj.weight.data_ptr()  # (in place: the model's own storage)
    fresh = load_state_dict(kv, "tiny@1")
    assert same(fresh, src.state_dict())
    manifest = checkpoint_manifest(kv, "tiny@1")
    assert [t["name"] for t in manifest["tensors"]] == list(src.state_dict())


def test_non_contiguous_tensors_save_and_load(kv):
    base = torch.randn(16, 12)
    save_state_dict(kv, "nc", {"t": base.t(), "s": base[:, ::2]}, chunk_bytes=CHUNK)
    into = {"t": torch.empty(24, 16).t()[:12], "s": torch.empty(16, 6)}  # a non-contiguous target too
    into["t"] = torch.empty(16, 12).t()
    loaded = load_state_dict(kv, "nc", into={"t": into["t"], "s": into["s"]})
    assert torch.equal(loaded["t"], base.t()) and torch.equal(into["t"], base.t())
    assert torch.equal(loaded["s"], base[:, ::2])


def test_strict_and_partial_loads(kv):
    src = Tiny(3).state_dict()
    save_state_dict(kv, "part", src, chunk_bytes=CHUNK)
    some = {"proj.weight": torch.empty(40, 24), "bf": torch.empty(33, dtype=torch.bfloat16), "other": torch.empty(1)}
    with pytest.raises(InvalidValue, match=r"not in the checkpoint: other.*only in it: .*embed\.weight"):
        load_state_dict(kv, "part", into=some)
    loaded = load_state_dict(kv, "part", into=some, strict=False)
    assert set(loaded) == {"proj.weight", "bf"}
    assert torch.equal(some["proj.weight"], src["proj.weight"]) and torch.equal(some["bf"], src["bf"])
    with pytest.raises(InvalidValue, match=r"into\['bf'\]: \(33,\) torch.float32"):
        load_state_dict(kv, "part", into={"bf": torch.empty(33)}, strict=False)
    with pytest.raises(InvalidValue, match=r"into\['proj.weight'\]: \(24, 40\)"):
        load_state_dict(kv, "part", into={"proj.weight": torch.empty(24, 40)}, strict=False)


def test_overwrite_replaces_and_frees_the_old_version(kv):
    first, second = Tiny(4).state_dict(), Tiny(5).state_dict()
    save_state_dict(kv, "v", first, chunk_bytes=CHUNK)
    old = checkpoint_manifest(kv, "v")
    with pytest.raises(KeyExists, match="overwrite=True"):
        save_state_dict(kv, "v", second, chunk_bytes=CHUNK)
    assert same(load_state_dict(kv, "v"), first)
    save_state_dict(kv, "v", second, chunk_bytes=CHUNK, overwrite=True)
    assert same(load_state_dict(kv, "v"), second)
    gone = [_object_key("v", old["version"], i) for i in range(len(old["objects"]))]
    assert kv.exists(gone) == [False] * len(gone)
    assert delete_checkpoint(kv, "v") is True and delete_checkpoint(kv, "v") is False
    with pytest.raises(KeyNotFound, match="no checkpoint 'v'"):
        load_state_dict(kv, "v")


def test_a_checkpoint_whose_objects_went_is_named_incomplete(kv):
    save_state_dict(kv, "holey", Tiny(6).state_dict(), chunk_bytes=CHUNK)
    manifest = checkpoint_manifest(kv, "holey")
    kv.delete(_object_key("holey", manifest["version"], 1))
    with pytest.raises(KeyNotFound, match="incomplete: object 1"):
        load_state_dict(kv, "holey")


def test_a_checkpoint_that_does_not_fit_leaves_nothing():
    with kvstrata.connect(embedded=True, memory_bytes="1MiB", segment_bytes="1MiB") as small:
        big = {f"w{i}": torch.zeros(64 << 10, dtype=torch.uint8) for i in range(24)}  # 1.5 MiB
        with pytest.raises(CapacityError, match="checkpoint 'big'"):
            save_state_dict(small, "big", big, chunk_bytes=256 << 10)
        assert small.stats()["objects"] == 0
        save_state_dict(small, "fits", {"w": torch.ones(1000)})
        assert torch.equal(load_state_dict(small, "fits")["w"], torch.ones(1000))


def test_load_waits_for_a_checkpoint_another_thread_saves(kv):
    src = Tiny(7).state_dict()
    # another client (a worker client's waiting request holds its connection, as in another process)
    saver = kvstrata.connect(store=kv.store) if kv.embedded else kvstrata.connect(kv.address)
    timer = threading.Timer(0.3, lambda: save_state_dict(saver, "later", src, chunk_bytes=CHUNK))
    timer.start()
    try:
        assert same(load_state_dict(kv, "later", timeout=30), src)
    finally:
        timer.join()
        saver.close()


def test_bad_input_is_named(kv):
    with pytest.raises(InvalidType, match=r"state_dict\['x'\]"):
        save_state_dict(kv, "bad", {"x": [1, 2]})
    with pytest.raises(InvalidType, match="state_dict"):
        save_state_dict(kv, "bad", [torch.ones(1)])
    with pytest.raises(InvalidType, match="name"):
        save_state_dict(kv, 7, {})
    with pytest.raises(InvalidValue, match="name"):
        save_state_dict(kv, "", {})
    with pytest.raises(InvalidValue, match="chunk_bytes"):
        save_state_dict(kv, "bad", {}, chunk_bytes=10)
    with pytest.raises(InvalidType, match="into"):
        save_state_dict(kv, "ok", {"a": torch.ones(2)})
        load_state_dict(kv, "ok", into=[torch.ones(2)])
    assert not kv.exists("ckpt/bad/manifest")
    kv.set("ckpt/garbled/manifest", b"{not json")
    with pytest.raises(InvalidValue, match="manifest"):
        load_state_dict(kv, "garbled")


def test_an_empty_state_dict(kv):
    info = save_state_dict(kv, "nothing", {})
    assert (info.tensors, info.objects) == (0, 0)
    assert load_state_dict(kv, "nothing") == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_model_to_gpu_model(kv):
    src, dst = Tiny(8).cuda(), Tiny(9).cuda()
    save_state_dict(kv, "gpu", src.state_dict())
    load_state_dict(kv, "gpu", into=dst)
    assert same(src.state_dict(), dst.state_dict())
    assert all(t.is_cuda for t in load_state_dict(kv, "gpu", device="cuda").values())


LOADER = """
import sys, torch, kvstrata
from kvstrata.integrations import load_state_dict
with kvstrata.connect(sys.argv[1], timeout=10) as kv:
    w = load_state_dict(kv, "shared", timeout=60)
    print(sum(float(t.double().sum()) for t in w.values()))
"""


def test_weights_go_from_one_process_to_several(worker, tmp_path):
    """Weight distribution: loaders in other processes wait for the checkpoint, then each loads it whole."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    loaders = [
        subprocess.Popen([sys.executable, "-c", LOADER, worker.address], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    weights = {f"w{i}": torch.randn(128, 64) for i in range(4)}
    with kvstrata.connect(worker.address) as saver:
        save_state_dict(saver, "shared", weights, chunk_bytes=CHUNK * 4)
        want = sum(float(t.double().sum()) for t in weights.values())
        outs = [p.communicate(timeout=120)[0] for p in loaders]
        assert all(p.returncode == 0 for p in loaders), outs
        assert [float(o) for o in outs] == [want, want]
        assert delete_checkpoint(saver, "shared")
