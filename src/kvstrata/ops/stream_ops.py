"""Stream-ordered 64-bit writes that need no SM: ``cuStreamWriteValue64`` through cuda-bindings.

A flag that tells another process "the bytes before me on this stream have landed" is usually
written by a tiny kernel or a copy from a device tensor that a kernel filled. A kernel waits for
a free SM, so under a compute load (a GEMM filling every SM) the flag - and whoever polls it - waits
for GEMM tiles to retire. ``cuStreamWriteValue64`` is executed by the stream's front end, ordered
after the preceding work of the stream (with a memory barrier unless told otherwise) and occupies no
SM. Where the driver API or the capability is missing, :func:`stream_writes_supported` says so and
callers keep their kernel path.

Example::

    if stream_writes_supported(device):
        write_value64(torch.cuda.current_stream(), device_address_of_flag, 42)
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)


@functools.cache
def driver():
    """cuda-bindings' driver module (``cuda.bindings.driver``), or None where it is not installed."""
    try:
        from cuda.bindings import driver as module
    except ImportError:
        try:
            from cuda import cuda as module  # cuda-python < 12.6 layout
        except ImportError:
            return None
    return module


@functools.cache
def stream_writes_supported(device_index: int) -> bool:
    """True when ``cuStreamWriteValue64`` can run on GPU ``device_index`` here."""
    drv = driver()
    if drv is None or not torch.cuda.is_available() or not hasattr(drv, "cuStreamWriteValue64"):
        return False
    attr_enum = drv.CUdevice_attribute
    prefix = "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS"
    names = (prefix, prefix + "_V1")
    attr = next((getattr(attr_enum, n) for n in names if hasattr(attr_enum, n)), None)
    if attr is None:
        return False
    torch.cuda.init()
    err, dev = drv.cuDeviceGet(device_index)
    if int(err) != 0:
        return False
    err, value = drv.cuDeviceGetAttribute(attr, dev)
    ok = int(err) == 0 and bool(value)
    log.debug("stream memory operations on GPU %d: %s", device_index, ok)
    return ok


def write_value64(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """Write ``value`` (uint64) at device-visible ``address`` once ``stream``'s earlier work is done."""
    drv = driver()
    (err,) = drv.cuStreamWriteValue64(
        drv.CUstream(stream.cuda_stream), drv.CUdeviceptr(int(address)), drv.cuuint64_t(int(value)), 0
    )
    if int(err) != 0:
        raise RuntimeError(f"cuStreamWriteValue64 failed: {err!r}")


__all__ = ["driver", "stream_writes_supported", "write_value64"]
