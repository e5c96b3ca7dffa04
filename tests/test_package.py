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


def test_bad_arguments_are_kvstrata_errors_and_builtins():
    assert issubclass(errors.InvalidValue, errors.InvalidArgument) and issubclass(errors.InvalidValue, ValueError)
    assert issubclass(errors.InvalidType, errors.InvalidArgument) and issubclass(errors.InvalidType, TypeError)
    assert not issubclass(errors.InvalidValue, TypeError) and not issubclass(errors.InvalidType, ValueError)


@pytest.mark.parametrize("cls", [errors.InvalidValue, errors.InvalidType, errors.KeyNotFound])
def test_error_classes_cross_the_wire(cls):
    from kvstrata.server.protocol import error_from_record, error_record

    back = error_from_record(error_record(cls("size: must be >= 0, got -1"))["err"])
    assert type(back) is cls and str(back) == "size: must be >= 0, got -1"


def test_an_embedded_store_names_an_option_it_does_not_have():
    with pytest.raises(errors.InvalidType, match=r"memory: not an option of an embedded store .*memory_bytes"):
        kvstrata.connect(embedded=True, memory="64MiB")
