"""Where a persistent step's time goes: ``python -m persistrnn bench step-profile``.

For each case (cell, hidden size, batch, dtype; one layer, one direction)
the configuration the planner runs (or ``--config``) is built twice: as it
ships, and instrumented (``KernelConfig.step_profile``), in which thread 0 of
every block adds up the SM cycles of each phase of a step
(:data:`persistrnn.persistent.STEP_PROFILE_PHASES`). Reported per case:

* µs per step of the shipped and the instrumented build, each from the
  difference of a long and a short launch (which cancels the launch and the
  prologue), the median of several CUDA-event timings after warm-up, so the
  instrumentation's own cost is visible;
* each phase in µs per step: the mean over blocks of thread 0's cycles,
  converted with that block's own cycles-to-nanoseconds ratio over the step
  loop (``globaltimer``), and the largest block's value;
* what no phase covers (the loop's own instructions).

A barrier phase is thread 0's wait there: the lag of the slowest warp of its
block. The exchange wait is the wait for the slowest peer block's push.
The instrumented build's outputs are checked bit for bit against the
shipped build's before anything is timed.

An A/B of kernel variants: ``--variant`` (repeatable) runs every case once
per variant, its fields applied over the configuration, in turn, and
``--rounds`` repeats the whole set, so variants alternate in one process
and a drift between rounds shows; ``--no-plan`` starts from the default
configuration instead of the planner's (nothing is tuned), for
configurations given field by field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import persistent, runtime
from ..cells import get_cell
from .environment import add_result_arguments, describe, parse_layer_case, run_or_load, write_result
from .timing import time_cuda_ms

PHASES = persistent.STEP_PROFILE_PHASES


@dataclasses.dataclass
class StepProfileConfig:
    cases: tuple[tuple[str, int, int, str], ...] = (
        ("lstm", 256, 1, "float32"), ("lstm", 256, 8, "float32"), ("lstm", 256, 20, "float32"),
        ("lstm", 1024, 1, "float32"), ("gru", 256, 1, "float32"), ("lstm", 64, 1, "float32"),
        ("lstm", 256, 8, "bfloat16"),
    )
    steps: int = 100
    repeats: int = 5
    config: str | None = None  # KernelConfig fields as k=v,k=v applied to every case's configuration
    variants: tuple[str, ...] = ()  # each case runs once per variant (k=v,k=v over ``config``), in turn
    rounds: int = 1  # the whole set of cases and variants, repeated
    from_plan: bool = True  # False: start from the default configuration (no tuning)


def phase_table(words: Any, config: persistent.KernelConfig) -> dict[str, Any]:
    """The profile words of one instrumented launch (see
    :func:`persistrnn.persistent.profile_words`) as µs per step: per phase
    the mean over blocks and the largest, the step loop's µs per step, and
    the part no phase covers. Each block's cycles convert to time with its
    own loop's ns per cycle. ``words``: an int array (slices × blocks,
    phases + 2); its step count is ``steps``."""
    import numpy as np

    rows = np.asarray(words, dtype=np.float64).reshape(-1, len(PHASES) + 2)
    cycles, loop_cycles, loop_ns = rows[:, :len(PHASES)], rows[:, -2], rows[:, -1]
    silent = np.flatnonzero((loop_cycles <= 0) | (loop_ns <= 0))
    if silent.size:
        # Which blocks tells a launch that never ran (all of them) from blocks that left the loop early.
        raise ValueError(f"profile of {config}: {silent.size} of {len(rows)} blocks recorded no step loop "
                         f"(blocks {silent[:8].tolist()}{' ...' if silent.size > 8 else ''}; rows are slice-major, "
                         f"cycles {loop_cycles.min():.0f}, ns {loop_ns.min():.0f}); did the launch run, or did "
                         "those blocks leave it on a failure?")
    if (cycles.sum(axis=1) > loop_cycles).any():
        raise ValueError(f"profile of {config}: the phases add up to more cycles than the step loop took")
    ns_per_cycle = loop_ns / loop_cycles
    per_block_ns = cycles * ns_per_cycle[:, None]
    return {
        "phases_ns": dict(zip(PHASES, per_block_ns.mean(axis=0).tolist())),
        "phases_max_ns": dict(zip(PHASES, per_block_ns.max(axis=0).tolist())),
        "loop_ns": float(loop_ns.mean()),
        "uncovered_ns": float((loop_ns - per_block_ns.sum(axis=1)).mean()),
        "clock_ghz": float((1 / ns_per_cycle).mean()),
        "blocks": len(rows),
    }


def parse_config_fields(text: str | None) -> dict[str, Any]:
    """KernelConfig fields from ``k=v,k=v`` (ints, ``True``/``False``, and the
    string fields ``cell``, ``sync``, ``dtype``, ``math``)."""
    if not text:
        return {}
    fields = {}
    known = {f.name for f in dataclasses.fields(persistent.KernelConfig)}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in known:
            raise ValueError(f"{key!r} is not a KernelConfig field")
        if key in ("cell", "sync", "dtype", "math"):
            fields[key] = value
        elif value in ("True", "False"):
            fields[key] = value == "True"
        else:
            fields[key] = int(value)
    return fields


def _chosen(cell: str, hidden: int, batch: int, dtype: str, fields: dict[str, Any],
            from_plan: bool = True) -> tuple[Any, Any, str]:
    """(configuration, batch slice, where it came from) for a case."""
    from ..plan import ModelShape, cached_plan

    chosen = cached_plan(ModelShape(cell, hidden, hidden, 1, dtype, False), batch) if from_plan else None
    if chosen is not None and chosen.path == "persistent":
        config, batch_slice, source = chosen.config, chosen.batch_slice, "plan"
    else:
        config = persistent.default_config(cell, hidden, batch, sm_count=runtime.device_facts().sm_count,
                                           dtype=dtype)
        batch_slice = None
        source = f"default (the plan runs {chosen.path})" if chosen is not None else "default"
    if fields:
        config, source = dataclasses.replace(config, **fields), source + " with " + ", ".join(
            f"{k}={v}" for k, v in fields.items())
    return config, batch_slice, source


def run_case(cell: str, hidden: int, batch: int, dtype: str, cfg: StepProfileConfig,
             variant: str | None = None) -> dict[str, Any]:
    import torch

    spec = get_cell(cell)
    G, H = spec.num_gates, hidden
    fields = parse_config_fields(cfg.config) | parse_config_fields(variant)
    config, batch_slice, source = _chosen(cell, hidden, batch, dtype, fields, cfg.from_plan)
    instrumented = dataclasses.replace(config, step_profile=True)
    dev, tdtype = torch.device("cuda"), getattr(torch, dtype)
    gen = torch.Generator(device=dev).manual_seed(hash((cell, hidden, batch, dtype)) % 2**31)
    w_hh = (torch.randn(G * H, H, device=dev, generator=gen) / H**0.5).to(tdtype)
    b_hh = torch.randn(G * H, device=dev, generator=gen).to(tdtype)
    h0 = torch.randn(batch, H, device=dev, generator=gen).to(tdtype)
    c0 = torch.randn(batch, H, device=dev, generator=gen).to(tdtype) if spec.has_cell_state else None
    long_steps = 10 * cfg.steps
    xw = torch.randn(long_steps, batch, G * H, device=dev, generator=gen)
    slices = -(-batch // min(batch_slice or batch, persistent.batch_per_launch(config, dev.index), batch))
    profile = torch.empty(persistent.profile_words(config, slices), dtype=torch.int64, device=dev)

    def launch(kernel_config: Any, steps: int, out: Any) -> None:
        instance = persistent.Instance(xw[:steps], w_hh, b_hh, h0, c0, out, torch.empty_like(h0),
                                       torch.empty_like(h0) if c0 is not None else None)
        persistent.run_instances(kernel_config, [instance], steps, batch, batch_slice=batch_slice, check=False,
                                 profile=profile if kernel_config.step_profile else None)

    outs = {}
    for kernel_config in (config, instrumented):
        outs[kernel_config.step_profile] = torch.full((cfg.steps, batch, H), float("nan"), dtype=tdtype, device=dev)
        launch(kernel_config, cfg.steps, outs[kernel_config.step_profile])
    runtime.raise_reported_failure(dev.index, persistent.KERNEL_NAME, synchronize=True)
    if not torch.equal(outs[False], outs[True]):
        raise RuntimeError(f"{instrumented}: the instrumented build's outputs differ from the shipped build's")
    per_step = {}
    scratch = torch.empty(long_steps, batch, H, dtype=tdtype, device=dev)
    runtime.warm_up(lambda: launch(config, long_steps, scratch))  # steady clocks first
    for kernel_config in (config, instrumented):
        short, long = (time_cuda_ms(lambda n=n, k=kernel_config: launch(k, n, scratch), warmup=2, repeats=cfg.repeats)
                       for n in (cfg.steps, long_steps))
        per_step[kernel_config.step_profile] = (long - short) / (long_steps - cfg.steps) * 1000
    profile.fill_(-1)
    launch(instrumented, long_steps, scratch)
    runtime.raise_reported_failure(dev.index, persistent.KERNEL_NAME, synchronize=True)
    table = phase_table(profile.cpu().numpy(), instrumented)
    scale = 1 / 1000 / long_steps  # ns over the loop -> µs per step
    return {
        "cell": cell, "hidden": hidden, "batch": batch, "dtype": dtype, "steps": long_steps,
        "config": dataclasses.asdict(config), "batch_slice": batch_slice, "source": source,
        "shipped_us_per_step": per_step[False], "instrumented_us_per_step": per_step[True],
        "loop_us_per_step": table["loop_ns"] * scale,
        "phases_us": {k: v * scale for k, v in table["phases_ns"].items()},
        "phases_max_us": {k: v * scale for k, v in table["phases_max_ns"].items()},
        "uncovered_us": table["uncovered_ns"] * scale, "clock_ghz": table["clock_ghz"], "blocks": table["blocks"],
    }


def run(cfg: StepProfileConfig, after_case: Any = None) -> dict[str, Any]:
    from .environment import environment

    result: dict[str, Any] = {"suite": "step-profile", "environment": environment(),
                              "config": dataclasses.asdict(cfg), "cases": []}
    for round_ in range(cfg.rounds):
        for case in cfg.cases:
            for variant in cfg.variants or (None,):
                result["cases"].append(run_case(*case, cfg, variant) | {"round": round_, "variant": variant})
                if after_case:
                    after_case(result)
    return result


def format_table(result: dict[str, Any]) -> str:
    names = " | ".join(p.replace("_", " ") for p in PHASES)
    lines = [f"| case | configuration | µs/step shipped | µs/step instrumented | {names} | not in a phase | "
             "SM GHz |", "|---" * (6 + len(PHASES)) + "|"]
    from ..plan import config_label

    for c in result["cases"]:
        # a run from before a phase existed has none for it
        phases = " | ".join(f"{c['phases_us'][p]:.3f} ({c['phases_max_us'][p]:.3f})" if p in c["phases_us"] else "—"
                            for p in PHASES)
        label = config_label(persistent.KernelConfig(**c["config"]), c["batch_slice"])
        round_ = f" (round {c['round'] + 1})" if result["config"].get("rounds", 1) > 1 else ""
        lines.append(f"| {c['cell']} {c['hidden']} b{c['batch']} {c['dtype']}{round_} | {c['source']}: {label} | "
                     f"{c['shipped_us_per_step']:.3f} | {c['instrumented_us_per_step']:.3f} | {phases} | "
                     f"{c['uncovered_us']:.3f} | {c['clock_ghz']:.2f} |")
    return "\n".join(lines) + ("\n\nPhases: µs per step, the mean over blocks of thread 0's time in the phase "
                               "(the largest block's in brackets).")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m persistrnn bench step-profile",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", default=None, metavar="CELL:H:B[:DTYPE]", type=parse_layer_case,
                        help="run only these cases, e.g. lstm:256:1 or lstm:256:8:bfloat16 (repeatable)")
    parser.add_argument("--steps", type=int, default=StepProfileConfig.steps,
                        help="the short launch's steps (the long one runs ten times as many)")
    parser.add_argument("--config", default=None,
                        help="KernelConfig fields as k=v,k=v, applied to every case's configuration")
    parser.add_argument("--variant", action="append", default=None, metavar="K=V[,K=V]",
                        help="run every case once per variant, these fields applied over --config (repeatable), "
                             "e.g. --variant tagged_exchange=False --variant tagged_exchange=True")
    parser.add_argument("--rounds", type=int, default=1, help="run the whole set of cases and variants this often")
    parser.add_argument("--no-plan", action="store_true",
                        help="start from the default configuration instead of the planner's (nothing is tuned)")
    add_result_arguments(parser)
    args = parser.parse_args(argv)
    for text in (args.config, *(args.variant or ())):
        try:
            parse_config_fields(text)
        except ValueError as err:
            parser.error(f"expected KernelConfig fields as k=v,k=v, got {text!r} ({err})")
    cfg = StepProfileConfig(steps=args.steps, config=args.config, variants=tuple(args.variant or ()),
                            rounds=args.rounds, from_plan=not args.no_plan)
    if args.case:
        cfg.cases = tuple(args.case)
    result = run_or_load(args, parser, "step-profile", lambda save: run(cfg, after_case=save))
    write_result(args, result, describe(result["environment"]) + "\n\n" + format_table(result) + "\n")
    return 0
