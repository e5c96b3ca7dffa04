"""The README's Python examples run as written (those that need no GPU pair, process group or worker process):
documentation that drifts from the API fails here, not in a user's first minute."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
# Blocks that need what a CPU test machine has not: a process group per GPU; two GPUs and a running worker.
NEEDS_MORE = ("dist.init_process_group", "dev_publish")


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _runnable() -> list[str]:
    return [b for b in _blocks() if not any(marker in b for marker in NEEDS_MORE)]


def test_the_readme_has_runnable_examples_and_skips_only_the_multi_gpu_ones():
    blocks = _blocks()
    assert len(blocks) >= 4
    skipped = [b for b in blocks if b not in _runnable()]
    assert len(skipped) == 2  # the all-gather and device-object sketches (their features have GPU tests of their own)


@pytest.mark.parametrize("index", range(len(_runnable())))
def test_readme_example_runs(index, tmp_path, capsys):
    code = _runnable()[index].replace("/tmp/kvstrata-readme", str(tmp_path / "ssd"))
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(code, f"README.md python block {index}", "exec"), namespace)
    kv = namespace.get("kv")
    if kv is not None:
        kv.close()
    assert capsys.readouterr().out  # each example prints what it shows
