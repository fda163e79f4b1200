"""Run the warp-specialised fused backward at small shapes, kernels compiled with -lineinfo, for
compute-sanitizer racecheck to name source lines:

    compute-sanitizer --tool racecheck python3 scripts/probes/ws_racecheck.py [-DFRT_X=1 ...]

Arguments are NVRTC defines added to every kernel (the A/B switches of bwd_sm90.cuh, say).
"""
import sys

import torch

import flashrt
from flashrt import spec

spec.NVRTC_OPTIONS = spec.NVRTC_OPTIONS + tuple(sys.argv[1:])
_options = spec.KernelSpec.options
spec.KernelSpec.options = lambda self: _options(self) + ["-lineinfo"]
for D in (64, 128):
    for S in (256, 300):
        q, k, v, do = (torch.randn(1, S, 2, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        out, lse = flashrt.forward(q, k, v)
        for det in (False, True):
            flashrt.backward(do, q, k, v, out, lse, impl="fused", deterministic=det)
torch.cuda.synchronize()
print("ran")
