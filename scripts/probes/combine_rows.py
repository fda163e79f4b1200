"""flashrt.combine's two kernels (combine.cu: warps per row, or combine_rows' thread per 8 columns) forced in turn
over rows x parts x head_dim: each checked against a float64 merge, timed by the profiler (kernel time only, the mean
of --reps calls), and the library's choice (tiles.combine_rows) printed beside them.

    python3 scripts/probes/combine_rows.py [--rows 64,1024,16384,262144] [--parts 2,4,8,16,32] [--dims 64,128,256]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def reference(o, lse):
    lse = lse.double()
    whole = torch.logsumexp(lse, 0)
    w = torch.exp(lse - torch.where(whole == -torch.inf, 0.0, whole)).permute(0, 1, 3, 2)[..., None]
    return (w * o.double()).sum(0), whole


def kernel_us(fn, reps):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = [e.device_time_total for e in prof.key_averages() if "combine" in e.key]
    return sum(times) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64,1024,16384,262144")
    ap.add_argument("--parts", default="2,4,8,16,32")
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    import flashrt
    from flashrt import api, tiles
    rule = tiles.combine_rows
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(), sm, "SMs")
    lines = ["| rows | parts | D | dtype | warps us | rows us | rows / warps | library | max err |",
             "|---|---|---|---|---|---|---|---|---|"]
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in map(int, args.rows.split(",")):
        H = 16
        Sq = rows // H
        for n in map(int, args.parts.split(",")):
            for D in map(int, args.dims.split(",")):
                for dtype in (torch.bfloat16, torch.float32) if n == 2 else (torch.bfloat16,):
                    o = torch.randn(n, 1, Sq, H, D, device="cuda", generator=g).to(dtype)
                    lse = torch.randn(n, 1, H, Sq, device="cuda", generator=g) * 3
                    lse[0, 0, 0, : Sq // 2] = -torch.inf  # rows part 0 did not see
                    if n > 1:
                        lse[:, 0, 1, :1] = -torch.inf  # a row no part saw
                    want_o, want_l = reference(o, lse)
                    us, err = {}, 0.0
                    for name, force in (("warps", False), ("rows", True)):
                        tiles.combine_rows = lambda *a, force=force: force
                        api._PLANS.clear()  # (combine's plans are kept per signature)
                        try:
                            out, got_l = flashrt.combine(o, lse)
                            err = max(err, float((out.double() - want_o).abs().max()),
                                      float((got_l.double() - want_l).nan_to_num(0, 0, 0).abs().max()))
                            assert torch.equal(torch.isinf(got_l), torch.isinf(want_l)), "-inf rows"
                            assert torch.equal(out, flashrt.combine(o, lse)[0]), "bitwise repeatable"
                            us[name] = kernel_us(lambda: flashrt.combine(o, lse), args.reps)
                        finally:
                            tiles.combine_rows = rule
                    lib = "rows" if rule(n, rows, sm) else "warps"
                    lines.append(f"| {rows} | {n} | {D} | {str(dtype)[6:]} | {us['warps']:.1f} | {us['rows']:.1f} | "
                                 f"{us['rows'] / us['warps']:.2f} | {lib} | {err:.1e} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
