import subprocess
import sys

import pytest

import kvstrata
from kvstrata import errors


def test_error_hierarchy_branches():
    assert issubclass(errors.TransportError, OSError)
    assert issubclass(errors.ConnectionLost, errors.TransportError)
    assert issubclass(errors.KeyNotFound, errors.ServerError)
    assert issubclass(errors.KeyNotFound, KeyError)
    assert issubclass(errors.Timeout, TimeoutError)
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.KvstrataError)
    assert str(errors.KeyNotFound("key 'a' not found")) == "key 'a' not found"


def test_unknown_attribute():
    with pytest.raises(AttributeError, match="no_such_thing"):
        _ = kvstrata.no_such_thing


def test_cli_help_runs():
    out = subprocess.run([sys.executable, "-m", "kvstrata.cli.main", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "bench" in out.stdout
