"""Whether the planner's choice holds in steady state: ``python -m persistrnn bench planner-regret``.

For every case of the chosen suites (grnn-table and real-models by default;
``--suites dtypes`` adds the 16-bit grid), in one process:

1. the plan every module call runs (:func:`persistrnn.plan.cached_plan`'s:
   the tuning cache's, or tuned now);
2. the candidates the tuner times for that model (the cost model's top
   ``k`` that compile, the first of each kernel family they leave out and
   a family's second where the model ties them,
   tagged twins, the fallback, cuDNN), plus the plan's own choice if
   it is not among them, each re-timed at the case's exact batch (the tuner
   times the batch bucket's top) at steady clocks: the GPU warmed up, then
   rounds that time every candidate once in turn, the median round kept
   (:func:`persistrnn.plan.tuner.time_candidates`);
3. regret = the chosen candidate's time / the fastest candidate's.

The target (data in :mod:`.targets`): mean regret at most 1.03 and worst at
most 1.10 over the cases.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from . import compare
from .compare import DTYPE_NAMES

DEFAULT_SUITES = ("grnn-table", "real-models")
MEAN_TARGET, WORST_TARGET = 1.03, 1.10


def regret_case(case: compare.Case, k: int) -> dict[str, Any]:
    """One case's plan, every candidate re-timed at the exact batch, and the regret."""
    from ..plan import ModelShape, cached_plan, tuner

    shape = ModelShape(case.cell, case.input, case.hidden, case.layers, case.dtype, case.bidirectional)
    chosen = cached_plan(shape, case.batch)
    model = tuner.cost.cost_model(progress=False)
    ranked = tuner.ranked_configs(shape, chosen.batch_bucket, model, case.steps)
    top = tuner.compile_top(ranked, k)
    if chosen.path == "persistent" and all(chosen.label != tuner.candidate_label(r) for r in top):
        top.append(tuner.Ranked(chosen.predicted_us, chosen.config, chosen.batch_slice))
    candidates = tuner.timing_candidates(shape, case.batch, top, case.steps)
    measured = tuner.time_candidates(candidates)
    timed = {label: ms for label, ms in measured.items() if ms == ms}  # NaN: could not launch here
    best = min(timed, key=timed.get)
    return {"model": case.model, "cell": case.cell, "hidden": case.hidden, "layers": case.layers,
            "bidirectional": case.bidirectional, "dtype": case.dtype, "steps": case.steps, "batch": case.batch,
            "plan": chosen.label, "plan_source": chosen.source, "chosen_ms": timed.get(chosen.label),
            "best": best, "best_ms": timed[best],
            "regret": timed[chosen.label] / timed[best] if chosen.label in timed else None,
            "measured_ms": measured}


def summary(cases: list[dict[str, Any]]) -> dict[str, Any]:
    regrets = [c["regret"] for c in cases if c["regret"] is not None]
    mean, worst = (statistics.fmean(regrets), max(regrets)) if regrets else (None, None)
    return {"cases": len(cases), "mean_regret": mean, "worst_regret": worst,
            "met": mean is not None and mean <= MEAN_TARGET and worst <= WORST_TARGET and len(regrets) == len(cases)}


def markdown(result: dict[str, Any]) -> str:
    from .environment import describe

    lines = ["# Planner regret (`python -m persistrnn bench planner-regret`)", "", describe(result["environment"]),
             f"- Method: each case's plan (the tuning cache's, or tuned now), then the tuner's top {result['k']} "
             "candidates, the fallback and cuDNN (and the plan's choice where it is not among them) re-timed at the "
             "exact batch in steady state: GPU warmed up, rounds that time every candidate once in turn (3 graph "
             "replays of one forward per timing), the median of 7 rounds. Regret = chosen / fastest.", "",
             "| model | dtype | T | batch | plan | chosen ms | fastest | fastest ms | regret |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in result["cases"]:
        regret = "—" if c["regret"] is None else f"{c['regret']:.3f}"
        lines.append(f"| {c['model']} | {DTYPE_NAMES[c['dtype']]} | {c['steps']} | {c['batch']} | {c['plan']} "
                     f"({c['plan_source']}) | {compare._fmt(c['chosen_ms'])} | {c['best']} | "
                     f"{compare._fmt(c['best_ms'])} | {regret} |")
    s = result["summary"]
    lines += ["", f"Mean regret {s['mean_regret']:.3f}, worst {s['worst_regret']:.3f} over {s['cases']} cases "
              f"(target: mean ≤ {MEAN_TARGET}, worst ≤ {WORST_TARGET}): **{'met' if s['met'] else 'missed'}**."
              if s["mean_regret"] is not None else "No case was timed."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from .environment import environment, write_result
    from ..progress import track

    p = argparse.ArgumentParser(prog="python -m persistrnn bench planner-regret", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suites", nargs="+", default=list(DEFAULT_SUITES), choices=sorted(compare.SUITES))
    p.add_argument("--k", type=int, default=5, help="persistent candidates re-timed per case (the tuner's k)")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    cases = list(dict.fromkeys(c for name in args.suites for c in compare.suite_cases(name)))
    result: dict[str, Any] = {"environment": environment(), "k": args.k, "suites": args.suites, "cases": []}
    for case in track(cases, not args.no_progress, "planner regret"):
        result["cases"].append(regret_case(case, args.k))
    result["summary"] = summary(result["cases"])
    text = markdown(result)
    write_result(args, result, text)
    return 0
