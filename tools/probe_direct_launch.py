"""Why ``ops._common.direct_launch`` does or does not take the direct C launch on this Triton (GPU machine).

PYTHONPATH=src python3 tools/probe_direct_launch.py
"""

import inspect

import torch
import triton
import triton.language as tl
from triton import knobs

from kvstrata.ops._common import direct_launch


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


x = torch.zeros(1024, device="cuda")
compiled = _add_one[(1,)](x, 1024, BLOCK=1024)
launcher = compiled.run
print("triton", triton.__version__, "launcher", type(launcher))
print("signature", list(inspect.signature(type(launcher).__call__).parameters))
for name in ("global_scratch_size", "profile_scratch_size", "launch_cooperative_grid", "launch_pdl"):
    print(name, getattr(launcher, name, "<missing>"))
print("hooks", knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
fire = direct_launch(compiled, 1)
print("direct:", getattr(fire, "__name__", fire))
