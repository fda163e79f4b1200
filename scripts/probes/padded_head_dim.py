"""Head_dims between the wgmma instances: the kernels padded to the next instance up (tiles.sm90_head_dim, the
library's default from tiles.PADDED_FROM) against mma.sync's own variants at that head_dim (tiles.PADDED_FROM patched
past 256), with torch SDPA's flash and cuDNN backends in the same run.

    python scripts/probes/padded_head_dim.py [--rounds 7] [--seqlens 1024,4096,16384] [--head-dims 48,72,80,96,...]
                                             [--padded-from N]  (tiles.PADDED_FROM for the padded form)
                                             [--passes fwd,bwd] [--check-only]

Checks first: both forms' out, dq, dk, dv against float64 at a ragged GQA shape, causal and not. Then flashrt.forward
alone and flashrt.backward alone (impl="auto", deterministic=True; ten calls a timing; SDPA's backward through
torch.autograd.grad of a kept graph), medians over interleaved rounds, at 16k tokens and H = 2048 // head_dim
(score_mod_cost.grid). TFLOP/s: 4 B H S^2 D at the tensors' head_dim (2.5x that backward), halved when causal. Prints
a table last (docs/perf-notes.md: Padded head_dims).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import flashrt  # noqa: E402
from flashrt import api, reference, tiles  # noqa: E402
from score_mod_cost import grid, grid_args, medians  # noqa: E402

_PADDED_FROM = [tiles.PADDED_FROM]  # (--padded-from)
FORMS = ("padded", "mma.sync", "flash", "cudnn")


def use(padded: bool) -> None:
    tiles.PADDED_FROM = _PADDED_FROM[0] if padded else 257
    tiles.kernel_for.cache_clear()
    api._PLANS.clear()


def reference_of(q, k, v, do, causal) -> tuple:
    """float64 (out, dq, dk, dv) on the host."""
    ref = reference.attention(*(x.double().cpu().numpy() for x in (q, k, v)), causal=causal,
                              dout=do.double().cpu().numpy())
    return (ref[0], *ref[2:])


def errors(q, k, v, do, causal, ref) -> list[float]:
    """flashrt's out, dq, dk, dv against `ref` (reference_of): relative errors, inf where one holds a NaN."""
    out, lse = flashrt.forward(q, k, v, causal=causal)
    got = (out, *flashrt.backward(do, q, k, v, out, lse, causal=causal))
    return [float("inf") if bool(x.isnan().any()) else
            float(np.linalg.norm(x.double().cpu().numpy() - r) / np.linalg.norm(r)) for x, r in zip(got, ref)]


def check(head_dims) -> list[str]:
    rows = []
    for D in head_dims:
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(D * 2 + causal)
            q, do = (torch.randn(2, 333, 8, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
            k, v = (torch.randn(2, 517, 2, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
            ref = reference_of(q, k, v, do, causal)
            for padded in (True, False):
                use(padded)
                errs = errors(q, k, v, do, causal, ref)
                ok = max(errs) < 1e-2
                rows.append(f"| D{D} {'causal' if causal else 'full'} | {'padded' if padded else 'mma.sync'} | "
                            + " ".join(f"{e:.1e}" for e in errs) + f" | {'ok' if ok else 'FAIL'} |")
                print(rows[-1], flush=True)
    return rows


def sdpa(q, k, v, do, causal, backend, backward):
    """SDPA's forward, or its backward alone (autograd.grad through a kept graph), ten calls; raises RuntimeError where
    the backend does not take the case."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(backward) for x in (q, k, v))
    with sdpa_kernel(which):
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    dot = do.transpose(1, 2)

    def run():
        with sdpa_kernel(which):
            for _ in range(10):
                if backward:
                    torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True)
                else:
                    torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    run()
    return run


def main():
    ap = grid_args(head_dims="48,72,80,96,112,160,224")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--padded-from", type=int, default=tiles.PADDED_FROM)
    ap.add_argument("--passes", default="fwd,bwd")
    a = ap.parse_args()
    _PADDED_FROM[0] = a.padded_from
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    checks = check(list(map(int, a.head_dims.split(","))))
    table = []
    for D, S, H, q, k, v, do in ([] if a.check_only else grid(a)):
        B = q.shape[0]
        for causal in (False, True):
            for pass_ in a.passes.split(","):
                backward = pass_ == "bwd"

                def ours(padded):
                    use(padded)
                    out, lse = flashrt.forward(q, k, v, causal=causal)
                    if backward:  # (its plan made here: the table names its kernel)
                        flashrt.backward(do, q, k, v, out, lse, causal=causal)

                    def run():
                        use(padded)
                        for _ in range(10):
                            if backward:
                                flashrt.backward(do, q, k, v, out, lse, causal=causal)
                            else:
                                flashrt.forward(q, k, v, causal=causal)
                    return run
                cases = {"padded": ours(True)}
                plan = list(api._PLANS.values())[-1].launches.launches  # (the padded form's: its main kernel)
                kernel = max((spec for spec, *_ in plan), key=lambda spec: spec.smem_bytes).name
                cases["mma.sync"] = ours(False)
                for peer in ("flash", "cudnn"):
                    try:
                        cases[peer] = sdpa(q, k, v, do, causal, peer, backward)
                    except RuntimeError:
                        pass
                ms = medians(cases, a.rounds)
                flops = 4 * B * H * S * S * D / (2 if causal else 1) * (2.5 if backward else 1)
                tf = {n: flops * 10 / (t * 1e-3) / 1e12 for n, t in ms.items()}
                table.append(f"| {D} | {S} | {'causal' if causal else 'full'} | {pass_} | "
                             + " | ".join(f"{tf[n]:.0f}" if n in tf else "n/a" for n in FORMS)
                             + f" | {tf['padded'] / tf['mma.sync']:.2f} | {kernel} |")
                print(table[-1], flush=True)
    print("\n| case | form | rel err out dq dk dv | |\n|---|---|---|---|")
    print("\n".join(checks))
    if table:
        print("\nTFLOP/s (at the tensors' head_dim), flashrt.forward / flashrt.backward alone, 16k tokens, "
              "H = 2048 // D:")
        print("| D | S | mask | pass | padded | mma.sync | SDPA flash | cuDNN | padded / mma.sync | padded kernel |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(table))


if __name__ == "__main__":
    main()
