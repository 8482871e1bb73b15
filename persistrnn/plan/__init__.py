"""The planner: configuration space (:mod:`.space`), cost model (:mod:`.model`),
top-K tuning and its cache (:mod:`.tuner`).

``tune(model, batch)`` times the model's top K and remembers the fastest;
``explain(model, batch)`` prints what would run and why, with the predicted
cost. ``model`` is a ``torch.nn.LSTM``/``GRU``/``RNN`` or a :class:`ModelShape`.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from .tuner import (DEFAULT_K, DEFAULT_STEPS, ModelShape, Plan, cached_plan, clear_cached_plans, config_label, pin_plan,
                    plan, shape_of)

__all__ = ["ModelShape", "Plan", "cached_plan", "clear_cached_plans", "config_label", "pin_plan", "plan", "tune",
           "explain", "shape_of"]


def _shape(model: Any) -> ModelShape:
    return model if isinstance(model, ModelShape) else shape_of(model)


def tune(model: Any, batch: int, *, k: int = DEFAULT_K, steps: int = DEFAULT_STEPS, progress: bool = True,
         refresh: bool = False) -> Plan:
    """Tune ``model`` for ``batch`` on the current GPU: compile the cost
    model's top ``k`` configurations, time them with the fallback and cuDNN on
    ``steps`` steps, and cache the fastest. A cached choice is returned at
    once unless ``refresh``."""
    return plan(_shape(model), batch, tune=True, k=k, steps=steps, progress=progress, refresh=refresh)


def explain(model: Any, batch: int, *, top: int = 5, file: TextIO | None = None) -> Plan:
    """Print the plan for ``model`` at ``batch`` (the tuned choice if one is
    cached, else the cost model's) and the model's ``top`` ranked
    configurations with their predicted cost by term. Returns the plan."""
    from . import model as cost, space
    from .tuner import ranked_configs, tf32_allowed

    out = file or sys.stdout
    shape = _shape(model)
    chosen = plan(shape, batch, tune=False)
    print(chosen.describe(), file=out)
    bucket = space.batch_bucket(batch)
    cm = cost.cost_model(progress=False, batch=bucket)
    ranked = ranked_configs(shape, bucket, cm, tf32=tf32_allowed(shape))
    if ranked:
        print(f"  cost model, top {min(top, len(ranked))} of {len(ranked)} candidates "
              f"(µs per step: product + pointwise + barriers + exchange):", file=out)
        for us, config, batch_slice in ranked[:top]:
            c = cm.step_cost(config, bucket, batch_slice)
            print(f"    {us:7.2f} = {c.product:.2f} + {c.pointwise:.2f} + {c.barriers:.2f} + {c.exchange:.2f}"
                  f"{f' over {c.launches} launches' if c.launches > 1 else ''}"
                  f"{f' in {c.waves} waves' if c.waves > 1 else ''}"
                  f"{f' in slices of {batch_slice}' if batch_slice else ''}  {config}", file=out)
    return chosen
