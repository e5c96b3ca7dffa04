"""Probe the GPU machine for the facts kvstrata's device code relies on (run once per new image)."""

import ctypes
import json
import mmap
import os
import subprocess
import time

import torch
import triton
import triton.language as tl

res = {}


def sh(cmd):
    return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()


res["nvidia_smi"] = sh(
    "nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv"
)
res["topo"] = sh("nvidia-smi topo -m")
res["numa_online"] = sh("cat /sys/devices/system/node/online")
res["hugepages"] = sh(
    "cat /proc/meminfo | grep -i huge; ls -la /dev/hugepages 2>&1 | head -3;"
    " cat /sys/kernel/mm/transparent_hugepage/enabled"
)
res["dev_shm"] = sh("df -h /dev/shm")
res["mem"] = sh("free -g")
res["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda}
res["versions"]["triton"] = triton.__version__
try:
    import cuda.bindings
    from cuda.bindings import runtime as rt

    res["versions"]["cuda_bindings"] = cuda.bindings.__version__
    res["has_batch"] = hasattr(rt, "cudaMemcpyBatchAsync")

    try:
        res["batch_doc"] = (rt.cudaMemcpyBatchAsync.__doc__ or "")[:1500]
    except Exception as e:
        res["batch_doc"] = repr(e)
except Exception as e:
    res["cuda_bindings"] = repr(e)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    res[f"dev{i}"] = {
        "name": p.name,
        "pci": [getattr(p, "pci_domain_id", None), getattr(p, "pci_bus_id", None), getattr(p, "pci_device_id", None)],
        "uuid": str(getattr(p, "uuid", "")),
        "sms": p.multi_processor_count,
    }
    bdf = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    res[f"dev{i}"]["numa"] = sh(f"cat /sys/bus/pci/devices/{bdf}/numa_node")
res["stream_priority_range"] = torch.cuda.Stream.priority_range()
# cudaHostRegister through torch's cudart
m = mmap.mmap(-1, 64 << 20)
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
t = torch.frombuffer(m, dtype=torch.uint8)
t.fill_(7)
cudart = torch.cuda.cudart()
rc = cudart.cudaHostRegister(addr, 64 << 20, 3)
res["cudaHostRegister_rc"] = str(rc)
res["is_pinned_after_register"] = bool(t.is_pinned())


class CAI:
    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


v = torch.as_tensor(CAI(addr, 64 << 20), device="cuda")
res["uva_view_ptr_equal"] = v.data_ptr() == addr
v[:10] = 3
torch.cuda.synchronize()
res["uva_write_seen_on_host"] = int(t[0]) == 3
d = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    t0 = time.perf_counter()
    for _ in range(10):
        d.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
res["h2d_registered_GBps"] = round(10 * (64 << 20) / (time.perf_counter() - t0) / 1e9, 1)
# memfd hugetlb
try:
    fd = os.memfd_create("probe", os.MFD_HUGETLB)
    os.ftruncate(fd, 4 << 20)
    mm = mmap.mmap(fd, 4 << 20)
    mm[0:1] = b"x"
    res["memfd_hugetlb"] = "ok"
except Exception as e:
    res["memfd_hugetlb"] = repr(e)
res["peer_access"] = [torch.cuda.can_device_access_peer(0, 1)] if torch.cuda.device_count() > 1 else None
try:
    import cupy
    from cupy.cuda import nccl

    res["cupy"] = cupy.__version__
    res["cupy_nccl_version"] = nccl.get_version()
except Exception as e:
    res["cupy"] = repr(e)


@triton.jit
def k(ptrs, out, n, BLOCK: tl.constexpr):
    p = tl.load(ptrs).to(tl.pointer_type(tl.uint8))
    o = tl.arange(0, BLOCK)
    tl.store(out + o, tl.load(p + o, mask=o < n), mask=o < n)


try:
    ptrs = torch.tensor([addr], dtype=torch.int64, device="cuda")
    out = torch.zeros(16, dtype=torch.uint8, device="cuda")
    k[(1,)](ptrs, out, 16, BLOCK=16)
    torch.cuda.synchronize()
    res["triton_int_to_ptr_host"] = out[:4].tolist()
except Exception as e:
    res["triton_int_to_ptr_host"] = repr(e)[:500]
print(json.dumps(res, indent=1, default=str))
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.json"), "w") as f:
    json.dump(res, f, indent=1, default=str)
