"""Test helper: a GPU device call's stages on a machine without a GPU (``kvstrata.client.device.stages``
cuts a call into stages only once it meets a CUDA tensor; tests patch this in to exercise the pipeline)."""

from kvstrata.client import device


def stages_of(n):
    """A ``stages`` replacement that cuts every call into stages of ``n`` keys."""

    def stages(n_keys, tensor_lists):
        device.check_outer(n_keys, tensor_lists)
        for lo in range(0, n_keys, n):
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
