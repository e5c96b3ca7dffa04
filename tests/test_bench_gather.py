import json

import pytest
import torch

from kvstrata.cli.main import main


def test_bench_gather_smoke_writes_checked_results(tmp_path, capsys):
    assert main(["bench", "gather", "--smoke", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "gather_smoke.json").read_text())
    assert record["environment"]["command"]
    methods = {(r["rows"], r["method"]) for r in record["rows"]}
    assert methods == {(16, "kvstrata"), (16, "reference"), (64, "kvstrata"), (64, "reference")}
    assert all(r["correct"] for r in record["rows"])
    assert "kvstrata" in capsys.readouterr().out


@pytest.mark.gpu
def test_bench_gather_quick_on_gpu(tmp_path):
    assert torch.cuda.is_available()
    assert main(["bench", "gather", "--quick", "--rows", "1024", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "gather_quick.json").read_text())
    methods = {r["method"] for r in record["rows"]}
    assert {"kvstrata", "to_cuda", "dma_ceiling", "index_select_uva", "cpu_gather_pinned"} <= methods
