"""A/B of compile-time variants in one probe process: after a probe patches what a kernel is built from (a KernelSpec
property, spec.NVRTC_OPTIONS, a tiles rule), fresh() drops what the library has loaded, planned and cached, so that
the next call compiles and plans the variant now patched in. What was dropped stays alive here: CUDA graphs captured
earlier still launch those kernels and use those plans' buffers. interleaved_ms() times the variants against each
other."""
import statistics

from flashrt import api, launch, tiles

_kept = []


def fresh() -> None:
    _kept.extend(list(launch._functions.values()) + list(api._PLANS.values()))
    launch._functions.clear()
    api._PLANS.clear()
    for f in vars(tiles).values():  # (cached specs hold their shared-memory size)
        if hasattr(f, "cache_clear"):
            f.cache_clear()


def interleaved_ms(runs, use, call, rounds: int, reps: int) -> dict:
    """Median milliseconds of call() under each of `runs` (use(run) patches that variant in), in interleaved rounds of
    `reps` timed calls after one untimed one. Each variant is planned once (a plan holds its kernels) and its plans
    swapped in before its calls."""
    import torch

    plans = {}
    for run in runs:
        use(run)
        call()
        plans[run] = dict(api._PLANS)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {run: [] for run in runs}
    for _ in range(rounds):
        for run in runs:
            api._PLANS.clear()
            api._PLANS.update(plans[run])
            call()
            start.record()
            for _ in range(reps):
                call()
            end.record()
            end.synchronize()
            times[run].append(start.elapsed_time(end) / reps)
    return {run: statistics.median(t) for run, t in times.items()}
