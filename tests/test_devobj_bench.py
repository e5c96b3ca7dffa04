"""``kvstrata bench device --smoke`` runs without a GPU and writes its JSON."""

from __future__ import annotations

import argparse
import json

import pytest

from kvstrata.bench import device


def test_smoke_writes_timings(tmp_path, capsys):
    assert device.smoke(argparse.Namespace(out=str(tmp_path))) == 0
    record = json.loads((tmp_path / "device_smoke.json").read_text())
    assert record["environment"]["command"]
    timings = record["timings"]
    assert set(timings) >= {"broker_publish_subscribe_complete_us", "handoff_subscriber_first_us", "mget_one_key_us"}
    assert all(v > 0 for v in timings.values())
    assert "handoff_publisher_first_us" in capsys.readouterr().out


def test_keys_per_call_fills_about_2GiB():
    assert device.keys_per_call(64 << 20, quick=False) == 32
    assert device.keys_per_call(1 << 30, quick=True) == 2
    assert device.keys_per_call(4096, quick=True) == 64


def test_broadcast_finish_times_by_chain_position():
    sender = {"t0": {"memcpy": [0.0, 10.0, 20.0]}}
    receivers = [  # which process holds a position may change between rounds; the first round is warm-up
        {"device": 1, "landed": {"memcpy": [{"position": 1, "copied": c} for c in (0.5, 10.006, 20.006)]}},
        {"device": 0, "landed": {"memcpy": [{"position": 0, "copied": c} for c in (0.5, 10.005, 20.007)]}},
    ]
    out = device.bcast_finish_ms(sender, receivers)["memcpy"]
    assert [(r["position"], r["device"]) for r in out] == [(0, 0), (1, 1)]
    assert out[0]["ms"] == 6.0 and out[1]["ms"] == 6.0


def test_hand_offs_alternate_offers_on_and_off_evenly():
    from kvstrata.bench.device import offers_on

    pattern = [offers_on(i) for i in range(8)]
    assert pattern == [True, False, False, True] * 2  # neither variant always goes first
    assert sum(offers_on(i) for i in range(200)) == 100


BAD_NUMBERS = [["--wait", "-5"], ["--rounds", "0"], ["--chunk-mib", "0"], ["--broadcast-gib", "inf"]]


@pytest.mark.parametrize("flags", BAD_NUMBERS)
def test_bench_device_refuses_bad_numbers(flags, capsys):
    from kvstrata.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "device", "--smoke", *flags])
    assert exc.value.code == 2 and flags[0] in capsys.readouterr().err


def test_a_bad_results_folder_fails_before_the_run(tmp_path):
    from kvstrata.cli.main import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit, match="--out: cannot make the folder"):
        main(["bench", "device", "--smoke", "--out", str(blocker / "results")])
