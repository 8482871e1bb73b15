"""Persistent recurrence kernels: one launch of ``kernels/recurrence.cu``
runs every time step of one layer (or of several layers and directions).

The path is: :class:`KernelConfig` (:mod:`.config`, validated; its sizes in
:mod:`.layout`) -> :func:`render_source` -> :func:`compile_config` (NVRTC,
disk cache; :mod:`.source`) -> :func:`run_recurrence` / :func:`forward_model`
(:mod:`.launch`). :func:`default_config` (:mod:`.heuristic`) picks a
configuration from sizes alone; the planner replaces it with a tuned choice.
"""

from ..checks import check_lengths, check_tensor
from ..errors import ConfigError
from .config import (DTYPES, KERNEL_NAME, MATH_PATHS, MAX_CLUSTER, MAX_INSTANCES, MAX_REGISTERS_PER_THREAD,
                     MAX_SLICE_SEQUENCES, PIPELINE_RELEASE_EVERY, STEP_PROFILE_PHASES, SYNC_MODES,
                     TAGGED_READS_PER_THREAD, KernelConfig)
from .heuristic import blocks_for, default_config
from .launch import (Instance, batch_per_launch, forward_layer, forward_model, input_projection, launched_config,
                     profile_words, run_instances, run_recurrence)
from .layout import MMA_BATCH, MMA_TILE, REGISTER_OVERHEAD, WARP, KernelLayout
from .source import DEVICE_TYPES, compile_config, instance_fields, render_source

__all__ = [
    "DEVICE_TYPES", "DTYPES", "KERNEL_NAME", "MATH_PATHS", "MAX_CLUSTER", "MAX_INSTANCES", "MAX_REGISTERS_PER_THREAD",
    "MAX_SLICE_SEQUENCES", "MMA_BATCH", "MMA_TILE", "PIPELINE_RELEASE_EVERY", "REGISTER_OVERHEAD",
    "STEP_PROFILE_PHASES", "SYNC_MODES", "TAGGED_READS_PER_THREAD", "WARP", "ConfigError",
    "Instance", "KernelConfig", "KernelLayout", "batch_per_launch", "blocks_for", "check_lengths", "check_tensor",
    "compile_config", "default_config", "forward_layer", "forward_model", "input_projection", "instance_fields",
    "launched_config", "profile_words", "render_source", "run_instances", "run_recurrence",
]
