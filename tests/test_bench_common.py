"""What every benchmark's JSON says about the code that ran: kvstrata's version, the git commit and whether the
package's files differ from it (None where git or a checkout is missing)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import kvstrata
from kvstrata.bench import _common

PACKAGE = Path(kvstrata.__file__).resolve().parent


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def test_environment_names_the_version_and_the_commit():
    env = _common.environment()
    assert env["kvstrata"] == kvstrata.__version__
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(PACKAGE), "rev-parse"]).returncode:
        assert env["git_commit"] is None and env["git_dirty"] is None
    else:
        assert env["git_commit"] == _git("rev-parse", "HEAD", cwd=PACKAGE)
        assert isinstance(env["git_dirty"], bool)


@pytest.mark.skipif(shutil.which("git") is None, reason="no git here")
def test_git_state_of_a_clean_and_a_dirty_checkout(tmp_path):
    repo = tmp_path / "repo"
    pkg = repo / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (repo / "other.txt").write_text("outside the package\n")
    _git("init", "-q", cwd=repo)
    _git("add", ".", cwd=repo)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one", cwd=repo)
    head = _git("rev-parse", "HEAD", cwd=repo)
    assert _common.git_state(pkg) == {"git_commit": head, "git_dirty": False}
    (repo / "other.txt").write_text("changed, but not the package's code\n")
    assert _common.git_state(pkg)["git_dirty"] is False
    (pkg / "new.py").write_text("y = 2\n")  # an untracked module runs too
    assert _common.git_state(pkg) == {"git_commit": head, "git_dirty": True}
    (pkg / "new.py").unlink()
    (pkg / "a.py").write_text("x = 2\n")
    assert _common.git_state(pkg)["git_dirty"] is True


def test_git_state_without_git_or_a_checkout(tmp_path, monkeypatch):
    assert _common.git_state(tmp_path) == {"git_commit": None, "git_dirty": None}  # not a checkout
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on the PATH
    assert _common.git_state(PACKAGE) == {"git_commit": None, "git_dirty": None}
    env = _common.environment()
    assert env["git_commit"] is None and env["git_dirty"] is None and env["kvstrata"] == kvstrata.__version__
