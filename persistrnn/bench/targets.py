"""The speed targets of the kernel and module issues, judged on measured runs.

Every comparison suite's markdown ends with the targets its cases bear on,
met or missed. ``python -m persistrnn bench targets RESULT.json ...`` judges
them over several suites' JSON results at once (the published
``docs/results/targets-h100.md`` is made this way). A target no given run
measured is listed as "not measured", never left out.

A target names the cases it applies to by their fields and the suites whose
runs judge it, then what it asks: a bound on our graph time, a least speed-up
over cuDNN (graph, eager or both), or bounds between two times of the same
case (:class:`Relation`: our eager call against its own graph replay, the
compiled module against the eager one); and the known cause shown when it is
missed: the analysis in ``docs/perf-notes.md``, which a run cannot derive.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from .compare import DTYPE_NAMES, best_cudnn, providers, ratio

FIRST_CALL_LIMIT_S = 10.0
""""Seconds, not a minute": the bound we hold the first call of a new shape to."""


@dataclasses.dataclass(frozen=True)
class Relation:
    """``subject`` ≤ ``factor`` × ``reference`` + ``plus_us``, two times of one case.

    Each side is (provider, time key) of the case's rows ("ms": eager, CUDA
    events back to back; "graph_ms": replayed from a CUDA graph); the
    provider "cudnn" stands for cuDNN's faster setting (TF32 allowed or off).
    ``labels`` name the two sides in the measured column."""

    subject: tuple[str, str]
    reference: tuple[str, str]
    factor: float = 1.0
    plus_us: float = 0.0
    labels: tuple[str, str] = ("ours", "reference")


@dataclasses.dataclass(frozen=True)
class Target:
    text: str
    issue: str
    where: tuple[tuple[str, Any], ...]
    """Case fields a case must have; a tuple value lists the allowed values."""
    max_ms: float | None = None
    """Our graph-replay device time per forward must be at most this."""
    min_speedup: float | None = None
    against: tuple[str, ...] = ("eager",)
    """Which cuDNN time the speed-up is over: "eager", "graph" or both (eager against eager, graph against graph)."""
    cause: str = ""
    relations: tuple[Relation, ...] = ()
    """Bounds between two times of the same case, all of which must hold. A
    case whose reference provider has no peer there (torch has no such cell)
    is not one the target applies to."""
    suites: tuple[str, ...] = ()
    """The suites whose runs judge the target, in order of preference: a case
    that several runs measured is judged from the first of these suites (from
    the first run given, within one suite)."""
    name_model: bool = False
    """Whether the case column names the model and T (a target over many models)."""


def _one_layer(cell: Any, hidden: int, batch: Any, dtype: Any = "float32") -> tuple[tuple[str, Any], ...]:
    return (("cell", cell), ("hidden", hidden), ("input", hidden), ("layers", 1), ("bidirectional", False),
            ("dtype", dtype), ("steps", 100), ("batch", batch))


KERNEL = "persistent inference kernels"
MODULES = "drop-in modules"
RUNTIME = "one runtime: concurrency, a lean eager call, torch.compile"
COMPARISON_SUITES = ("grnn-table", "real-models", "scaling", "dtypes")
HOST_SUITES = ("host", "grnn-table", "real-models")
"""The host-time suite measures these targets on purpose; the comparison
suites' eager and graph times are the same measurement, so their runs judge
the cases the host suite did not run."""
EAGER_OVER_GRAPH_US = 25.0
""""An eager call's time is at most its graph device time + 25 µs": the host
path may cost no more than this beyond the device work."""
COMPILED_OVER_EAGER = 1.1
"""Under ``torch.compile`` (default mode), at most this times the eager module's time."""
KERNELS_V2 = "kernels v2: the floor at every batch and dtype"
SAME_CALL_NOISE = 0.02
"""Where the plan is cuDNN, "ours" and "cuDNN" are two graph timings of the same
cuDNN call: they measured up to 1% apart (grnn-table, LSTM/GRU 1024 at batch 20)."""
V2_CELLS = ("lstm", "gru", "gru_reset_before")
"""The kernels-v2 targets hold for LSTM and both GRU forms alike."""
STEP_CHAIN = ("A step is a chain of the product (~0.34 µs), the pointwise update (~0.3 µs, one thread per unit and "
              "column) and the exchange (~0.2 µs), with ~0.1 µs of barriers between: ~0.9 µs at batch 1 against a "
              "0.3 µs sync floor; the fused step removes one barrier (perf-notes §24, §50).")
SLICE_STEP = ("Batch slices fill the SMs, but each slice's step costs 1.3-1.6 µs, the batch-1 phase chain plus "
              "its columns (perf-notes §22).")
LARGE_FP32 = ("H=1024 needs the grid (64+ SMs): its exchange costs ~1.1 µs of a 1.8 µs step (a GPU-scope release, a "
              "counter barrier, h read back from L2; perf-notes §50). The one-round-trip exchange, timed beside "
              "each batch-1 grid candidate, takes LSTM 1024 with the fused step from 0.243 to 0.201 ms (§51); "
              "it lost at every batch-2 configuration timed. TF32 mma.sync is not built.")
SMALL_H = ("At H=64 one SM's step is latency-bound: 0.32 µs at batch 1 on the fused single-block build with one "
           "sequence compiled in, 0.31 in a stand-alone probe of the thread-per-row design, plus ~11 µs of launch "
           "and prologue: ~0.04-0.05 ms at T=100, against cuDNN's 0.056 (perf-notes §62, §64).")
HALF = ("16-bit: B fragments are read from an fp32 h with scalar loads and conversions; the ldmatrix path is "
        "not built.")
PHASES = ("About 0.9 µs per step against a 0.33 µs cluster sync floor: a step is a chain of block-wide phases "
          "(product, pointwise, exchange), each paying its latency (perf-notes §9).")
TARGETS = (
    Target("LSTM H=256, batch 1: ≤ 0.06 ms and ≥ 15× cuDNN eager", KERNEL, _one_layer("lstm", 256, 1),
           max_ms=0.06, min_speedup=15, cause=PHASES, suites=COMPARISON_SUITES),
    Target("LSTM H=256, batch 10 / 20: ≤ 0.12 ms and ≥ 8× cuDNN eager", KERNEL, _one_layer("lstm", 256, (10, 20)),
           max_ms=0.12, min_speedup=8,
           cause="The product grows with the batch on the same few SMs; at batch 20 the planner timed cuDNN as "
                 "faster than our top 5.", suites=COMPARISON_SUITES),
    Target("LSTM H=1024, batch 1: ≤ 0.25 ms", KERNEL, _one_layer("lstm", 1024, 1), max_ms=0.25,
           cause="H=1024 runs on the grid (128 blocks). Its fastest exchange, the tagged words, varies by process "
                 "and machine with the code unchanged: 0.204-0.319 ms per forward of the same binary in two processes "
                 "on two machines (perf-notes §68), 0.20-0.27 in the suites.", suites=COMPARISON_SUITES),
    Target("LSTM H=1024, batch 20, fp32: ≤ 0.6 ms", KERNEL, _one_layer("lstm", 1024, 20), max_ms=0.6,
           cause="The weights need 64+ SMs (grid mode, an exchange through L2 each step), and cuDNN's GEMMs win.",
           suites=COMPARISON_SUITES),
    Target("LSTM H=1024, batch 20, bf16: ≤ 0.35 ms", KERNEL, _one_layer("lstm", 1024, 20, "bfloat16"),
           max_ms=0.35,
           cause="mma tiles at batch 20 leave most of each 8-column tile idle (perf-notes §9).",
           suites=COMPARISON_SUITES),
    Target("LSTM H=64, batch 1–20: ≤ 0.04 ms", KERNEL, _one_layer("lstm", 64, tuple(range(1, 21))),
           max_ms=0.04,
           cause=SMALL_H, suites=COMPARISON_SUITES),
    Target("LSTM fp16/bf16, H=256, batch 8 and 16: ≤ 0.05 ms", KERNEL,
           _one_layer("lstm", 256, (8, 16), ("float16", "bfloat16")), max_ms=0.05,
           cause="The same phase chain; the 16-bit product saves little at these sizes (perf-notes §9).",
           suites=COMPARISON_SUITES),
    Target("LSTM fp16/bf16, H=1024, batch 8 and 16: ≤ 0.15 ms", KERNEL,
           _one_layer("lstm", 1024, (8, 16), ("float16", "bfloat16")), max_ms=0.15,
           cause="As at batch 20: mma tiles idle at small batch, and the phase chain per step.",
           suites=COMPARISON_SUITES),
    Target("char-RNN (3-layer LSTM 128, T=100), batch 1/5/10/20/40: ≤ 0.10 ms", MODULES,
           (("model", "char-RNN"), ("dtype", "float32")), max_ms=0.10,
           cause="The fused pipeline runs ~1.2 µs per step against 0.74 µs for one layer: the next-layer product "
                 "and the handover cost ~0.2 µs each (perf-notes §16); from batch 10 cuDNN timed faster.",
           suites=COMPARISON_SUITES),
    Target("text classification (2-layer LSTM 256, T=20), batch 1/5/10/20/40: ≤ 0.05 ms", MODULES,
           (("model", "text classification"), ("dtype", "float32")), max_ms=0.05,
           cause="The pipeline's cost per step as for char-RNN, plus its fill on a 20-step sequence; from batch "
                 "10 cuDNN timed faster.", suites=COMPARISON_SUITES),
    Target("bidirectional 2-layer LSTM 256, T=100, batch 8: ≥ 5× cuDNN (eager and graph)", MODULES,
           (("model", "bidirectional"), ("dtype", "float32")), min_speedup=5, against=("eager", "graph"),
           cause="Both directions run at once, but a layer still pays the per-step phase chain; cuDNN's graph "
                 "replay removes its host cost, which is most of its eager time.", suites=COMPARISON_SUITES),
    Target("v2: H=64, batch 1–20 (LSTM, GRU, reset-before GRU): ≤ 0.035 ms", KERNELS_V2,
           _one_layer(V2_CELLS, 64, tuple(range(1, 21))), max_ms=0.035, cause=SMALL_H, suites=COMPARISON_SUITES),
    Target("v2: H=256, batch 1 (LSTM, GRU, reset-before GRU): ≤ 0.05 ms", KERNELS_V2, _one_layer(V2_CELLS, 256, 1),
           max_ms=0.05, cause=STEP_CHAIN, suites=COMPARISON_SUITES),
    Target("v2: H=256, batch 10 (LSTM, GRU, reset-before GRU): ≤ 0.12 ms", KERNELS_V2,
           _one_layer(V2_CELLS, 256, 10), max_ms=0.12, cause=SLICE_STEP, suites=COMPARISON_SUITES),
    Target("v2: H=256, batch 20 (LSTM, GRU, reset-before GRU): ≤ 0.14 ms", KERNELS_V2,
           _one_layer(V2_CELLS, 256, 20), max_ms=0.14, cause=SLICE_STEP, suites=COMPARISON_SUITES),
    Target("v2: LSTM H=256, batch 64: ≤ 0.30 ms", KERNELS_V2, _one_layer("lstm", 256, 64), max_ms=0.30,
           cause=SLICE_STEP, suites=COMPARISON_SUITES),
    Target("v2: H=1024, batch 1 (LSTM, GRU, reset-before GRU): ≤ 0.15 ms", KERNELS_V2,
           _one_layer(V2_CELLS, 1024, 1), max_ms=0.15, cause=STEP_CHAIN + " " + LARGE_FP32,
           suites=COMPARISON_SUITES),
    Target("v2: H=1024, batch 20, fp32 exact (LSTM, GRU, reset-before GRU): ≤ 0.45 ms", KERNELS_V2,
           _one_layer(V2_CELLS, 1024, 20), max_ms=0.45, cause=LARGE_FP32, suites=COMPARISON_SUITES),
    Target("v2: fp16 and bf16, H=256, batch 8 and 16: ≤ 0.07 ms", KERNELS_V2,
           _one_layer(("lstm", "gru"), 256, (8, 16), ("float16", "bfloat16")), max_ms=0.07, cause=HALF,
           suites=COMPARISON_SUITES),
    Target("v2: fp16 and bf16, H=1024, batch 8 and 16: ≤ 0.15 ms", KERNELS_V2,
           _one_layer(("lstm", "gru"), 1024, (8, 16), ("float16", "bfloat16")), max_ms=0.15, cause=HALF,
           suites=COMPARISON_SUITES),
    Target("v2: char-RNN (3-layer LSTM 128, T=100), batch 1: ≤ 0.08 ms", KERNELS_V2,
           (("model", "char-RNN"), ("batch", 1)), max_ms=0.08, cause=STEP_CHAIN, suites=COMPARISON_SUITES),
    Target("v2: char-RNN (3-layer LSTM 128, T=100), batch 40: ≤ 0.20 ms", KERNELS_V2,
           (("model", "char-RNN"), ("batch", 40)), max_ms=0.20, cause=SLICE_STEP, suites=COMPARISON_SUITES),
    Target("v2: text classification (2-layer LSTM 256, T=20), batch 1: ≤ 0.035 ms", KERNELS_V2,
           (("model", "text classification"), ("batch", 1)), max_ms=0.035, cause=STEP_CHAIN,
           suites=COMPARISON_SUITES),
    Target("v2: text classification (2-layer LSTM 256, T=20), batch 40: ≤ 0.08 ms", KERNELS_V2,
           (("model", "text classification"), ("batch", 40)), max_ms=0.08, cause=SLICE_STEP,
           suites=COMPARISON_SUITES),
    Target(f"v2: never slower than cuDNN's faster setting (graph against graph, within {SAME_CALL_NOISE:.0%}, "
           "the spread of two timings of one cuDNN call): every case with a cuDNN peer", KERNELS_V2, (),
           relations=(Relation(("persistrnn", "graph_ms"), ("cudnn", "graph_ms"), factor=1 + SAME_CALL_NOISE,
                               labels=("ours graph", "cuDNN graph")),),
           cause="A plan that lost to cuDNN at this batch in this run (planner-regret re-times the plans); where "
                 "the plan is cuDNN itself, one call timed twice.",
           suites=COMPARISON_SUITES, name_model=True),
    Target(f"eager call ≤ its graph device time + {EAGER_OVER_GRAPH_US:.0f} µs: every grnn-table and real-models "
           "case",
           RUNTIME, (), relations=(Relation(("persistrnn", "ms"), ("persistrnn", "graph_ms"),
                                            plus_us=EAGER_OVER_GRAPH_US, labels=("eager", "graph")),),
           cause="With the native replay and the graphs' own copy nodes a call's host time is 20-73 µs on the "
                 "H100's host (median 38; 55-130 before the native replay), below every case's device time; what "
                 "is left over the graph is a device-bound call's copies around the launch (~5-40 µs of device "
                 "time at ~1 ms, where the copies are spread) and the spread of one timing: at ~1 ms a call's two "
                 "timings differ by run (LSTM 1024 b20: +22, +26, +17 and +24 µs in four runs; GRU 1024 b20 on "
                 "cuDNN +38) (perf-notes §56, §59, §60).",
           suites=HOST_SUITES, name_model=True),
    Target("eager call no slower than torch's eager call: every grnn-table and real-models case with a torch peer",
           RUNTIME, (), relations=(Relation(("persistrnn", "ms"), ("cudnn", "ms"), labels=("eager", "cuDNN eager")),),
           cause="A cuDNN plan where torch's eager call is itself device-bound: our replay of the same cuDNN call "
                 "adds the copies in and out (perf-notes §19, §56).",
           suites=HOST_SUITES, name_model=True),
    Target(f"torch.compile (default mode): ≤ {COMPILED_OVER_EAGER}× the eager persistrnn module, and no slower than "
           "eager torch.nn", RUNTIME, (),
           relations=(Relation(("persistrnn compiled", "ms"), ("persistrnn", "ms"), factor=COMPILED_OVER_EAGER,
                               labels=("compiled", "eager")),
                      Relation(("persistrnn compiled", "ms"), ("torch.nn", "ms"),
                               labels=("compiled", "torch.nn eager"))),
           cause="The compiled call is host-bound: torch.compile's own per-call path (Dynamo's frame and guards, "
                 "AOT-autograd's runtime wrapper, inductor's size asserts) costs ~63 µs of the H100's host around "
                 "one pointwise kernel (`compiled x + 1` in the suite's host columns), and the compiled module "
                 "88-117 µs at the host's faster moments and 134-193 µs at its slower ones (its speed moves ~2x "
                 "from second to second), against 72-90 µs of device time for an eager call that stays "
                 "device-bound (perf-notes §20, §60, §72).",
           suites=("compile",), name_model=True),
)


def _key(case: dict[str, Any]) -> tuple:
    return tuple(case[k] for k in ("model", "cell", "input", "hidden", "layers", "bidirectional", "dtype", "steps",
                                   "batch"))


def _rows_of(case: dict[str, Any], provider: str) -> list[dict[str, Any]]:
    """The case's rows of ``provider``; "cudnn" means every cuDNN setting's row."""
    if provider == "cudnn":
        return [r for r in case["rows"] if r["provider"].startswith("cudnn")]
    return [r for r in case["rows"] if r["provider"] == provider]


def _applies(target: Target, case: dict[str, Any]) -> bool:
    if not all(case[k] in v if isinstance(v, tuple) else case[k] == v for k, v in target.where):
        return False
    # A bound against a peer that torch does not have (the reset-before GRU) does not apply.
    for relation in target.relations:
        rows = _rows_of(case, relation.reference[0])
        if rows and all(r["status"] == "no peer" for r in rows):
            return False
    return True


def _time(case: dict[str, Any], provider: str, key: str) -> float | None:
    if provider == "cudnn":
        return best_cudnn(case, key)
    rows = [r for r in _rows_of(case, provider) if r["status"] == "ok"]
    return rows[0].get(key) if rows else None


def _judge_relations(target: Target, case: dict[str, Any]) -> tuple[str, str]:
    parts, met = [], True
    for relation in target.relations:
        subject, reference = relation.labels
        for provider, _ in (relation.subject, relation.reference):
            failed = [r for r in _rows_of(case, provider) if r["status"] not in ("ok", "no peer")]
            if failed and len(failed) == len(_rows_of(case, provider)):
                return "missed", f"{provider} {failed[0]['status']}: {failed[0]['note']}"
        have, want = _time(case, *relation.subject), _time(case, *relation.reference)
        if have is None or want is None:
            parts.append(f"no {subject if have is None else reference} time")
            met = False
            continue
        met &= have <= relation.factor * want + relation.plus_us / 1e3
        parts.append(f"{subject} {have:.3f} ms vs {reference} {want:.3f} ms: {have / want:.2f}×, "
                     f"{(have - want) * 1e3:+.0f} µs")
    plan = next((r["plan"] for r in _rows_of(case, "persistrnn") if r.get("plan")), "")
    return ("met" if met else "missed"), "; ".join(parts) + (f" (plan: {plan})" if plan else "")


def judge(target: Target, case: dict[str, Any]) -> tuple[str, str]:
    """(status, measured) of one target on one case."""
    if target.relations:
        return _judge_relations(target, case)
    ours = providers(case)["persistrnn"]
    if ours["status"] != "ok":
        return "missed", f"persistrnn {ours['status']}: {ours['note']}"
    parts, met = [f"{ours['graph_ms']:.3f} ms ({ours['plan']})"], True
    if target.max_ms is not None:
        met &= ours["graph_ms"] <= target.max_ms
    for against in target.against if target.min_speedup is not None else ():
        key = "graph_ms" if against == "graph" else "ms"
        sp = ratio(best_cudnn(case, key), ours[key])
        parts.append("no cuDNN time" if sp is None else f"{sp:.1f}× cuDNN {against}")
        met &= sp is not None and sp >= target.min_speedup
    return ("met" if met else "missed"), ", ".join(parts)


def _first_call_rows(result: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(r, c) for c in result["cases"] for r in c["rows"]
            if r["provider"] == "persistrnn" and r.get("first_call_s") is not None]


def _first_calls(results: list[dict[str, Any]]) -> tuple[str, str] | None:
    """Over the first calls that tuned: a first call whose plan came from the cache measures nothing new."""
    rows = [row for res in results for row in _first_call_rows(res)]
    if not rows:
        return None
    times = [(r["first_call_s"], c["model"], c["batch"]) for r, c in rows if r.get("tuned")]
    if not times:
        return "not measured", f"every one of {len(rows)} first calls found its plan in the cache"
    worst = max(times)
    within = sum(t <= FIRST_CALL_LIMIT_S for t, _, _ in times)
    return ("met" if worst[0] <= FIRST_CALL_LIMIT_S else "missed",
            f"{min(times)[0]:.1f}–{worst[0]:.1f} s over the {len(times)} first calls that tuned, {within} within "
            f"{FIRST_CALL_LIMIT_S:.0f} s (slowest: {worst[1]}, batch {worst[2]})")


def _tf32(result: dict[str, Any], case: dict[str, Any]) -> bool:
    """Whether ``case`` ran fp32 with TF32 allowed (``--matmul-precision high``):
    judged and labelled apart from an exact fp32 run of the same case."""
    return case["dtype"] == "float32" and result.get("settings", {}).get("matmul_precision", "highest") != "highest"


def _case_label(target: Target, case: dict[str, Any], tf32: bool = False) -> str:
    label = f"{DTYPE_NAMES[case['dtype']]}{' (TF32 allowed)' if tf32 else ''}, batch {case['batch']}"
    return f"{case['model']}, T={case['steps']}, {label}" if target.name_model else label


def _runs_for(target: Target, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs that judge ``target``, the preferred suites' first (stable: given order within a suite)."""
    if not target.suites:
        return list(results)
    return sorted((r for r in results if r.get("suite") in target.suites),
                  key=lambda r: target.suites.index(r["suite"]))


def evaluate(results: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One row per target and case it applies to (judged from the first run, of
    the target's preferred suite, that measured the case), in the targets' order."""
    rows = []
    for target in TARGETS:
        seen: dict[tuple, tuple[str, dict[str, Any], bool]] = {}
        for res in _runs_for(target, results):
            for case in res["cases"]:
                if _applies(target, case):
                    tf32 = _tf32(res, case)
                    seen.setdefault((*_key(case), tf32), (res.get("suite", "?"), case, tf32))
        if not seen:
            rows.append({"target": target.text, "issue": target.issue, "case": "—", "measured": "not measured",
                         "status": "not measured", "cause": "", "source": ""})
        for suite, case, tf32 in seen.values():
            status, measured = judge(target, case)
            rows.append({"target": target.text, "issue": target.issue, "case": _case_label(target, case, tf32),
                         "measured": measured,
                         "status": status, "cause": target.cause if status == "missed" else "", "source": suite})
    first = _first_calls(results)
    if first:
        rows.append({"target": f"first call of a new shape: seconds, not a minute (≤ {FIRST_CALL_LIMIT_S:.0f} s)",
                     "issue": KERNEL, "case": "every case", "measured": first[1], "status": first[0],
                     "cause": "Tuning compiles and times the model's top 5 configurations (and their builds for whole "
                              "slices), the fallback and cuDNN; the first tuned call of a process on a machine without "
                              "a calibration cache also runs the cost model's micro-benchmarks for its batch's tiles "
                              "(once per device), and a later first call at a larger batch those of its tiles. On "
                              "fresh H100 machines (perf-notes §70) the first call of a process took 7.1-9.1 s "
                              "(10.3-12.7 s before the calibration by tile): 3.1-4.5 s of calibration (tile 1, the "
                              "sync floors and the mma, pointwise and barrier tables), ~0.5 s of ranking and 3-5 s of "
                              "tuning; the next new shapes took 4.4-8.1 s, of it their tiles' timings (1.2-1.5 s) or "
                              "the end of their compiles ahead."
                              if first[0] == "missed" else "",
                     "source": ", ".join(dict.fromkeys(r.get("suite", "?") for r in results if _first_call_rows(r)))})
    return rows


def format_targets(results: list[dict[str, Any]], measured_only: bool = True) -> str:
    """The targets as a markdown table; ``measured_only`` drops the ones no run measured."""
    rows = [r for r in evaluate(results) if not (measured_only and r["status"] == "not measured")]
    if not rows:
        return "No case of this run bears on a speed target."
    lines = ["| target | case | measured | status | cause of a miss | run |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        status = r["status"] if r["status"] == "not measured" else f"**{r['status']}**"
        lines.append(f"| {r['target']} | {r['case']} | {r['measured']} | {status} | {r['cause']} | {r['source']} |")
    met = sum(r["status"] == "met" for r in rows)
    missed = sum(r["status"] == "missed" for r in rows)
    return "\n".join(lines) + f"\n\n{met} met, {missed} missed, of {len(rows)} rows."


def main(argv: list[str] | None = None) -> int:
    from .environment import describe

    p = argparse.ArgumentParser(prog="python -m persistrnn bench targets", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path,
                   help="JSON results (--json) of the comparison suites, the host suite and the compile suite")
    p.add_argument("--markdown", type=Path)
    args = p.parse_args(argv)
    results = []
    for path in args.results:
        try:
            result = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            p.error(f"{path}: expected a suite's JSON result, could not read it ({exc})")
        if not isinstance(result, dict) or "cases" not in result or "suite" not in result:
            p.error(f"{path}: expected a comparison suite's JSON result (with 'suite' and 'cases'), got another file")
        results.append(result)
    table = format_targets(results, measured_only=False)
    if args.markdown:
        sources = "\n".join(f"- `{p.name}` ({r['suite']}):\n" + "\n".join("  " + line for line in
                                                                            describe(r["environment"]).splitlines())
                            for p, r in zip(args.results, results))
        args.markdown.write_text(
            "# Speed targets of the kernel and module issues\n\nJudged by `python -m persistrnn bench targets` "
            "from these runs. Times are device ms per forward from CUDA-graph replays; speed-ups are cuDNN's "
            "faster setting (through `torch.nn`, same process) over ours. The host-path and `torch.compile` "
            "targets compare two times of one case, each the median of CUDA-event timings of calls back to back "
            "(eager, graph replay, compiled). The cause of a miss is the analysis in "
            f"`docs/perf-notes.md`.\n\n{sources}\n\n{table}\n\nNot judged here: the per-step time within 2× of the "
            "sync floor plus arithmetic, which needs the recurrence alone; see `recurrence-h100.md`.\n")
    print(table)
    return 0
