"""NUMA topology: which node a GPU hangs off, and binding memory ranges to a node.

The GPU's node comes from sysfs (``/sys/bus/pci/devices/<bdf>/numa_node``) through the PCI bus id
torch reports. Binding uses the ``mbind`` system call directly (no libnuma needed): policy
``MPOL_BIND`` with ``MPOL_MF_MOVE | MPOL_MF_STRICT`` so pages already touched move too.
Everything here degrades to "no NUMA" (``None`` / ``False``) on machines without it, and callers
record that fallback rather than hide it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
from pathlib import Path

from kvstrata.errors import InvalidValue

log = logging.getLogger(__name__)

_SYSFS_NODES = Path("/sys/devices/system/node")
_SYSFS_PCI = Path("/sys/bus/pci/devices")

_MPOL_BIND = 2
_MPOL_MF_STRICT = 1 << 0
_MPOL_MF_MOVE = 1 << 1
_MPOL_F_NODE = 1 << 0
_MPOL_F_ADDR = 1 << 1

# System call numbers differ per architecture; None where we do not know them (then: no binding).
_SYSCALLS = {
    "x86_64": {"mbind": 237, "get_mempolicy": 239},
    "aarch64": {"mbind": 235, "get_mempolicy": 236},
}

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _syscall_number(name: str) -> int | None:
    return _SYSCALLS.get(platform.machine(), {}).get(name)


def online_nodes() -> list[int]:
    """The NUMA nodes the kernel reports online (``[0]`` when sysfs has no node information)."""
    try:
        text = (_SYSFS_NODES / "online").read_text().strip()
    except OSError:
        return [0]
    nodes: list[int] = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            nodes.extend(range(int(lo), int(hi) + 1))
        elif part:
            nodes.append(int(part))
    return nodes or [0]


def pci_bus_id(device: int) -> str | None:
    """The PCI address (``dddd:bb:dd.f``) of CUDA device ``device``, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    domain = getattr(props, "pci_domain_id", None)
    bus = getattr(props, "pci_bus_id", None)
    dev = getattr(props, "pci_device_id", None)
    if bus is None or dev is None:
        return None
    return f"{domain or 0:04x}:{bus:02x}:{dev:02x}.0"


def numa_node(device: int | None = None) -> int | None:
    """The NUMA node of CUDA device ``device``'s PCIe slot (current device when None).

    Returns None when there is no GPU, no NUMA information, or the firmware reports -1 (a machine
    with a single node often does).
    """
    import torch

    if not torch.cuda.is_available():
        return None
    if device is None:
        device = torch.cuda.current_device()
    bdf = pci_bus_id(int(device))
    if bdf is None:
        return None
    for candidate in (bdf, bdf.lower()):
        path = _SYSFS_PCI / candidate / "numa_node"
        try:
            node = int(path.read_text().strip())
        except (OSError, ValueError):
            continue
        return node if node >= 0 else None
    return None


def bind(addr: int, nbytes: int, node: int) -> bool:
    """Bind the pages of ``[addr, addr + nbytes)`` to NUMA ``node`` (mbind MPOL_BIND, move, strict).

    ``addr`` must be page aligned (an mmap result is). Returns True when the kernel accepted the
    policy, False when this machine cannot bind (no syscall, single-node kernel without NUMA); the
    reason is logged at debug level. Raises ValueError for a node the machine does not have.
    """
    if nbytes <= 0:
        return False
    if node not in online_nodes():
        raise InvalidValue(f"node: NUMA node {node} is not online (online: {online_nodes()})")
    nr = _syscall_number("mbind")
    if nr is None:
        log.debug("mbind: unknown syscall number on %s", platform.machine())
        return False
    maxnode = max(online_nodes()) + 2
    words = (maxnode + 63) // 64
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] |= 1 << (node % 64)
    rc = _libc.syscall(
        nr,
        ctypes.c_void_p(addr),
        ctypes.c_ulong(nbytes),
        ctypes.c_int(_MPOL_BIND),
        mask,
        ctypes.c_ulong(maxnode),
        ctypes.c_uint(_MPOL_MF_MOVE | _MPOL_MF_STRICT),
    )
    if rc != 0:
        err = ctypes.get_errno()
        log.debug("mbind(node=%d) failed: %s", node, os.strerror(err))
        return False
    return True


def node_of_address(addr: int) -> int | None:
    """The NUMA node currently holding the page at ``addr`` (it must be touched), or None."""
    nr = _syscall_number("get_mempolicy")
    if nr is None:
        return None
    mode = ctypes.c_int(0)
    rc = _libc.syscall(
        nr,
        ctypes.byref(mode),
        None,
        ctypes.c_ulong(0),
        ctypes.c_void_p(addr),
        ctypes.c_ulong(_MPOL_F_NODE | _MPOL_F_ADDR),
    )
    if rc != 0:
        return None
    return mode.value


__all__ = ["bind", "node_of_address", "numa_node", "online_nodes", "pci_bus_id"]
