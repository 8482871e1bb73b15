"""Where a whole forward's device time goes: each kernel, memcpy and memset
of a CUDA-graph replay, with its duration and the gap before it, for the
planned persistrnn module and for torch.nn (cuDNN) on the same case; with
``--eager``, of the persistrnn module's eager call too (its own captured
call, with the copies in and out).

    python scripts/forward_timeline.py lstm 64 1 --dtype float32 --steps 100
    python scripts/forward_timeline.py gru 64 10 --dtype float16 --config sync=single,blocks=1

The graph replays are timed with CUDA events (median of 20 after a warm-up)
and then traced with torch.profiler (CUPTI) over a few replays; the trace's
span of one replay is printed beside its events. ``--config`` replaces the
planned persistent configuration's fields (as ``bench step-profile``).
"""

import argparse
import dataclasses
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import persistrnn
from persistrnn import persistent
from persistrnn.bench.step_profile import parse_config_fields
from persistrnn.bench.timing import time_cuda_ms, warm_up
from persistrnn.runtime import capture_graph


def events_of_replays(run, replays: int) -> list[list[tuple[str, float, float]]]:
    """[(name, start µs, duration µs)] of the device events of each ``run()``."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            run()
            torch.cuda.synchronize()
            time.sleep(1e-3)  # a gap between replays in the trace
    found = sorted(((e.name, e.time_range.start, e.time_range.end - e.time_range.start)
                    for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                   key=lambda e: e[1])
    # Replays are a millisecond apart: split where the gap exceeds 500 µs.
    groups: list[list[tuple[str, float, float]]] = [[]]
    for name, start, dur in found:
        if groups[-1] and start - (groups[-1][-1][1] + groups[-1][-1][2]) > 500:
            groups.append([])
        groups[-1].append((name, start, dur))
    return [g for g in groups if g]


def report(label: str, fn, x: torch.Tensor, eager: bool = False) -> None:
    if eager:
        run, how = (lambda: fn(x)), "eager call"
    else:
        run, how = capture_graph(lambda: fn(x)).replay, "graph replay"
    warm_up(run)
    ms = time_cuda_ms(run, warmup=3, repeats=20)
    replays = events_of_replays(run, 5)
    spans = [g[-1][1] + g[-1][2] - g[0][1] for g in replays]
    print(f"\n{label}: {how} {ms * 1000:.1f} µs (CUDA events, median of 20); "
          f"traced span of one {statistics.median(spans):.1f} µs over {len(replays)}")
    one = replays[len(replays) // 2]
    end = one[0][1]
    for name, start, dur in one:
        print(f"  gap {start - end:6.1f}  dur {dur:8.1f}  {name[:110]}")
        end = start + dur


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cell", choices=("lstm", "gru", "rnn"))
    ap.add_argument("hidden", type=int)
    ap.add_argument("batch", type=int)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--config", default=None,
                    help="KernelConfig fields k=v,... over the planned persistent configuration (or the default one)")
    ap.add_argument("--eager", action="store_true", help="trace the persistrnn module's eager call too")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    ref = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}[args.cell](
        args.hidden, args.hidden, args.layers).cuda().to(dtype).eval()
    ours = persistrnn.from_torch(ref).eval()
    x = torch.randn(args.steps, args.batch, args.hidden, device="cuda", dtype=dtype)
    plan = ours.plan_for(args.batch)
    if args.config:
        base = plan.config or persistent.default_config(
            args.cell, args.hidden, args.batch, dtype=args.dtype,
            sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
        forced = dataclasses.replace(plan, path="persistent", config=dataclasses.replace(
            base, **parse_config_fields(args.config)), batch_slice=None, reason="forced by --config", short_steps=0)
        ours.plan_for = lambda batch: forced
        plan = forced
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print(f"plan: {plan.path} {plan.config} slice={plan.batch_slice} ({plan.reason})")
    for name, ms in sorted(plan.measured_ms.items(), key=lambda kv: kv[1]):
        print(f"  tuner: {ms * 1000:7.1f} µs  {name}")
    persistrnn.runtime.native.available(wait=True)  # eager calls through the native replay, as the suites time them
    with torch.no_grad():
        out, want = ours(x)[0], ref(x)[0]
        print(f"max |ours - torch| = {(out.float() - want.float()).abs().max().item():.2e}")
        report("persistrnn", ours, x)
        if args.eager:
            report("persistrnn", ours, x, eager=True)
        report("torch.nn (cuDNN)", ref, x)


if __name__ == "__main__":
    main()
