"""The ``method="auto"`` policy: which transfer method to use, given measured rates (pure; no CUDA).

Rates come from :mod:`kvstrata.ops.calibration` (GB/s per direction, method and chunk size, measured on
this device). The policy is *SM-frugal*: a KV transfer runs beside the model, so the method that takes
fewest SMs from it wins unless it is clearly slower.

SM cost, lowest first (``PREFERENCE``):

* ``copy_engine``: DMA descriptors only, zero SMs.
* ``staging``: a short device-side gather (TB/s, on a high-priority stream) per 32 MiB piece, then DMA:
  SMs for a few percent of the transfer's duration (a GEMM beside it kept 100% of its throughput).
* ``zero_copy``: an SM kernel reading/writing host memory over PCIe holds its SMs for the whole
  transfer (a GEMM beside it kept 72%).

Rules, per call (``bulk``: more than ``SMALL_BYTES`` in the call):

1. Bulk: ``zero_copy`` is dropped when the best SM-frugal method reaches ``BULK_SM_FREE_SHARE`` of its
   rate. It stays only where it wins by far (or is the only candidate, e.g. ids that live on the device).
   Small calls (one request's blocks) keep it: its SMs are held for tens of microseconds and it has
   the lowest latency.
2. Among the rest, the first method in ``PREFERENCE`` within ``TOLERANCE`` of the fastest.
3. Two directions at once (:func:`pick_pair`): the same two rules over the *pairs* measured together.

Example::

    pick({"copy_engine": 2.1, "staging": 53.0, "zero_copy": 52.4}, bulk=True)   # -> "staging"
"""

from __future__ import annotations

from collections.abc import Mapping

PREFERENCE = ("copy_engine", "staging", "zero_copy")  # fewest SMs taken first
# An SM-frugal method within 2% of the fastest wins. Not more: the bandwidth target is 95% of the DMA
# ceiling and the fastest methods reach 96-98% of it, so a wider tolerance stacks onto that margin (at
# 5%, copy_engine at 128 KiB chunks was chosen at 0.952 of staging's calibrated rate and ran at 0.86 of
# the ceiling in the bench). Between copy_engine and staging the GEMM beside keeps 100% either way.
TOLERANCE = 0.98
# Bulk transfers: zero_copy is considered only when every SM-frugal method is below 80% of its rate.
# Beside zero_copy a GEMM kept ~72% of its throughput (H200, 32 CTAs reading host memory): a 20% faster
# transfer is the most that could pay for that, and only for a transfer that is itself the bottleneck.
BULK_SM_FREE_SHARE = 0.8
SMALL_BYTES = 4 << 20  # at most this much in one call: the latency regime ("small")


def sm_cost(method: str) -> int:
    """Rank of ``method`` in ``PREFERENCE`` (0: no SMs); unknown methods rank last."""
    return PREFERENCE.index(method) if method in PREFERENCE else len(PREFERENCE)


def eligible(rates: Mapping[str, float], *, bulk: bool) -> dict[str, float]:
    """Rule 1: the candidates left after dropping ``zero_copy`` from a bulk transfer it does not win by far."""
    rates = {m: r for m, r in rates.items() if r is not None}
    frugal = [r for m, r in rates.items() if m != "zero_copy"]
    zc = rates.get("zero_copy")
    if bulk and zc is not None and frugal and max(frugal) >= BULK_SM_FREE_SHARE * zc:
        rates.pop("zero_copy")
    return rates


def pick(rates: Mapping[str, float | None], *, bulk: bool) -> str | None:
    """The method to use given ``{method: GB/s}`` (None where nothing was measured)."""
    ok = eligible({m: r for m, r in rates.items() if r is not None}, bulk=bulk)
    if not ok:
        return None
    top = max(ok.values())
    return min((m for m, r in ok.items() if r >= TOLERANCE * top), key=lambda m: (sm_cost(m), -ok[m]))


def pick_pair(pairs: Mapping[tuple[str, str], float | None]) -> tuple[str, str] | None:
    """(d2h method, h2d method) for a store and a load at once, from ``{(d2h, h2d): GB/s of both}``.

    Rule 1 drops pairs with ``zero_copy`` unless they beat every SM-frugal pair by far; rule 2 takes the
    pair with the fewest SMs (sum of ranks) within ``TOLERANCE`` of the fastest."""
    ok = {p: r for p, r in pairs.items() if r is not None}
    if not ok:
        return None
    frugal = [r for p, r in ok.items() if "zero_copy" not in p]
    zc = [r for p, r in ok.items() if "zero_copy" in p]
    if frugal and zc and max(frugal) >= BULK_SM_FREE_SHARE * max(zc):
        ok = {p: r for p, r in ok.items() if "zero_copy" not in p}
    top = max(ok.values())
    near = [p for p, r in ok.items() if r >= TOLERANCE * top]
    return min(near, key=lambda p: (sm_cost(p[0]) + sm_cost(p[1]), -ok[p]))


__all__ = ["BULK_SM_FREE_SHARE", "PREFERENCE", "SMALL_BYTES", "TOLERANCE", "eligible", "pick", "pick_pair", "sm_cost"]
