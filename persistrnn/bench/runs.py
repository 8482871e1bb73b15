"""What the real training-run suites share (`bench charlm`, `bench sst`):
their command line, the loss-curve agreement against a float64 run, and the
two-panel plot.

Each suite trains persistrnn and a PyTorch peer from one initialisation on
one data order, and the peer in float64 for its first steps as the
yardstick of fp32 rounding. The suite module provides ``Settings`` (a
dataclass, every field a command-line option), ``run(settings, data_dir,
progress)`` and ``markdown(result)`` and ``plot(result, path)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable


def loss_agreement(ours: list[float], peer: list[float], float64: list[float]) -> dict[str, float]:
    """Largest relative loss difference over the steps the float64 run trained:
    each fp32 run against float64, and persistrnn against the peer."""
    n = len(float64)

    def worst(a: list[float], b: list[float]) -> float:
        return max((abs(x - y) / abs(y) for x, y in zip(a[:n], b[:n])), default=float("nan"))

    return {"persistrnn_vs_float64": worst(ours, float64), "peer_vs_float64": worst(peer, float64),
            "persistrnn_vs_peer": worst(ours, peer), "steps": n}


def agreement_text(a: dict[str, float], peer: str, agree: str) -> str:
    """The markdown sentence of :func:`loss_agreement`, judged by the suites'
    one rule: persistrnn within 2x the peer's own distance from float64, or
    1e-5. ``agree`` says what holds when it does."""
    rounding = max(2 * a["peer_vs_float64"], 1e-5)
    verdict = agree if a["persistrnn_vs_float64"] <= rounding else "**they do not**"
    return (f"Losses over the first {a['steps']} steps, largest relative difference: persistrnn against float64 "
            f"{a['persistrnn_vs_float64']:.1e}, {peer} (fp32) against float64 {a['peer_vs_float64']:.1e}, "
            f"persistrnn against {peer} {a['persistrnn_vs_peer']:.1e}: {verdict} (persistrnn within 2× {peer}'s "
            "own distance from float64, or 1e-5).")


def two_panels(path: Path, draw: Callable[[Any, Any], None]) -> str:
    """A two-panel figure (``draw(left, right)`` fills them) with grids and legends, written to ``path``."""
    from .compare import NO_MATPLOTLIB, _pyplot

    plt = _pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    draw(left, right)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def main(argv: list[str] | None, suite: str, module: Any, needs_gpu: Callable[[Any], bool]) -> int:
    """``python -m persistrnn bench <suite>``: every field of ``module.Settings``
    an option, ``--data``, ``--out`` (``<suite>.{md,json,png}``) and
    ``--from-json`` (write an earlier run's outputs again, no GPU)."""
    p = argparse.ArgumentParser(prog=f"python -m persistrnn bench {suite}", description=module.__doc__.split("\n\n")[0])
    defaults = module.Settings()
    for field in dataclasses.fields(module.Settings):
        p.add_argument(f"--{field.name.replace('_', '-')}", type=type(getattr(defaults, field.name)),
                       default=getattr(defaults, field.name))
    p.add_argument("--data", type=Path, default=None,
                   help="the data sets' folder (default: persistrnn.dynamic.DATA_DIR)")
    p.add_argument("--out", type=Path, default=None, help=f"write {suite}.{{md,json,png}} into this folder")
    p.add_argument("--from-json", type=Path, default=None, help=f"write the outputs of an earlier run's {suite}.json")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
    else:
        settings = module.Settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(module.Settings)})
        if needs_gpu(settings):
            from ..runtime import require_gpu

            require_gpu()
        result = module.run(settings, args.data, progress=not args.no_progress)
    text = module.markdown(result)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{suite}.json").write_text(json.dumps(result, indent=1))
        (args.out / f"{suite}.md").write_text(text)
        text += "\n" + module.plot(result, args.out / f"{suite}.png") + "\n"
    print(text)
    return 0
