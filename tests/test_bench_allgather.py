"""``kvstrata bench allgather``'s summary: labelled by the backend that ran, and only right results compete."""

from __future__ import annotations

from kvstrata.bench.allgather import _summarize


def _rows(r2_correct=True, auto_correct=True):
    def row(method, ms, busbw, correct=True, **extra):
        return {"size_mib": 1.0, "method": method, "ms": ms, "busbw_gbs": busbw, "correct": correct, **extra}

    return [
        row("nccl", 1.0, 10.0, ratio=None),
        row("host", 2.0, 5.0, ratio=1),
        row("hybrid r=2", 0.5, 20.0, correct=r2_correct, ratio=2, head="h"),
        row("hybrid r=4", 0.8, 12.5, ratio=4, head="h"),
        row("hybrid auto", 0.9, 11.0, correct=auto_correct, ratio="auto", auto_choice="r=4 h"),
        {"size_mib": 1.0, "method": "paired", "nccl_ms": 1.0, "auto_ms": 0.9, "auto_over_nccl": 0.9},
    ]


def test_the_baseline_is_labelled_by_its_backend():
    (smoke,) = _summarize(_rows(), "gloo")
    assert smoke["gloo GB/s"] == 10.0 and smoke["auto/gloo time"] == 0.9
    assert not any("nccl" in k for k in smoke)
    (gpu,) = _summarize(_rows(), "nccl")
    assert gpu["nccl GB/s"] == 10.0 and gpu["auto/nccl time"] == 0.9


def test_a_wrong_method_is_not_the_best_fixed_split_nor_meets_the_target():
    (line,) = _summarize(_rows(), "nccl")
    assert line["best fixed"] == "r=2 h" and line["<=1.03"] is True
    (line,) = _summarize(_rows(r2_correct=False), "nccl")
    assert line["best fixed"] == "r=4 h" and line["best GB/s"] == 12.5
    assert line["all correct"] is False
    (line,) = _summarize(_rows(auto_correct=False), "nccl")
    assert line["<=1.03"] is False and "gain/host auto" not in line
