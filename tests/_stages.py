"""Test helpers for the device calls without a GPU: a GPU call's stages (``kvstrata.client.device.stages``
cuts a call into stages only once it meets a CUDA tensor; tests patch this in to exercise the pipeline), the
one-pass paths' batches, and which path served a call."""

from kvstrata.client import device, kept_reads


def stages_of(n):
    """A ``stages`` replacement that cuts every call into stages of ``n`` keys."""

    def stages(n_keys, tensor_lists, start=0):
        device.check_outer(n_keys, tensor_lists)
        for lo in range(start, n_keys, n):
            checked = [device.check_key(tensor_lists[i], i) for i in range(lo, min(lo + n, n_keys))]
            yield device.Stage(lo, lo + len(checked), [c[0] for c in checked], [c[1] for c in checked], None)

    return stages


class _Landing:
    """A stage's end event whose copies are still landing when the call looks (``query()`` False)."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        pass


def copies_pending(monkeypatch):
    """Each stage's copies still in flight when the call gets to sealing or committing the stage before
    it, as on a GPU: one seal/commit request per stage (CPU copies have all landed: the call sends one)."""
    monkeypatch.setattr(device, "mark", lambda stream: _Landing())


def batches_of(monkeypatch, n, key_bytes):
    """Batches of ``n`` keys in the one-pass paths (a reserved ``mset_d2h``'s keys, a kept ``mget_h2d``'s), where
    every key's tensors are CPU tensors (no device runs: a batch is then cut by its bytes) of ``key_bytes`` or a
    little more (fewer than ``n`` keys hold less than ``n * key_bytes``)."""
    monkeypatch.setattr(kept_reads, "FIRST_RUNS", n)  # the kept read's first batch
    monkeypatch.setattr(device, "FIRST_BATCH_RUNS", n)  # the write's and the placed read's
    monkeypatch.setattr(device, "BATCH_RUNS", n)
    monkeypatch.setattr(kept_reads, "RUN_BYTES", key_bytes)


def outcomes(monkeypatch, module):
    """What each call of ``module.queue`` (a one-pass path: kvstrata.client.kept_reads, placed_reads) does from
    here on, in a list: True (it served the call), False (it left it to the staged path) or "raised"."""
    took: list[object] = []
    real = module.queue

    def queue(*args, **kwargs):
        try:
            got = real(*args, **kwargs)
        except BaseException:
            took.append("raised")
            raise
        took.append(got is not None)
        return got

    monkeypatch.setattr(module, "queue", queue)
    return took
