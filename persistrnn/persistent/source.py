"""Source rendering and compilation: a :class:`~.config.KernelConfig`
becomes a generated prelude (its sizes as macros, the cell's math) in front of
``kernels/recurrence.cu``, compiled by NVRTC through the runtime's disk cache.
"""

from __future__ import annotations

import functools

from .. import runtime
from ..cells import render_pointwise_functions
from ..errors import ConfigError
from .config import (KERNEL_NAME, PIPELINE_RELEASE_EVERY, RESIDENT_CONTROL, RESIDENT_TICK, STEP_PROFILE_PHASES,
                     SYNC_MODES, TAGGED_READS_PER_THREAD, KernelConfig)
from .layout import RESIDENT_PROJECTION_ROWS

__all__ = ["DEVICE_TYPES", "compile_config", "instance_fields", "render_source"]

DEVICE_TYPES = {"float32": "float", "float16": "prnn_f16", "bfloat16": "prnn_bf16"}


def instance_fields(config: KernelConfig) -> list[tuple[str, str]]:
    """(C type, name) of each per-instance kernel parameter, in order."""
    io = DEVICE_TYPES[config.dtype]
    fields = [("const float*", "xw"), (f"const {io}*", "w_hh"), (f"const {io}*", "b_hh"), (f"const {io}*", "h0"),
              (f"const {io}*", "c0"), (f"{io}*", "out"), (f"{io}*", "h_n"), (f"{io}*", "c_n"), ("int", "reverse"),
              (f"const {io}*", "xw_bias")]
    if config.pipeline:
        fields += [(f"const {io}*", "w_next"), (f"const {io}*", "b_next")]
    if config.save_gates:
        fields += [("float*", "saved_gates"), ("float*", "saved_c")]
    return fields


def _instance_params(config: KernelConfig) -> str:
    return ", ".join(f"{ctype} {name}_{i}" for i in range(config.instances) for ctype, name in instance_fields(config))


def _resident_params(config: KernelConfig) -> str:
    """The resident kernel's own parameters (see recurrence.cu), after the instances'."""
    if not config.resident_input_size:
        return ""
    io = DEVICE_TYPES[config.dtype]
    return (f", const {io}* __restrict__ w_ih, const {io}* __restrict__ b_ih, long long* __restrict__ ctl, "
            "long long first_tick, long long generation, unsigned long long idle_ns, unsigned long long lifetime_ns")


def _profile_params(config: KernelConfig) -> str:
    """An instrumented build's one more parameter (see recurrence.cu's PRNN_MARK)."""
    return ", unsigned long long* __restrict__ profile" if config.step_profile else ""


def _select_instance(config: KernelConfig) -> str:
    """This block's instance's parameters as plain names (a select chain:
    an indexed array of parameters would live in local memory). A resident
    kernel's are variables: each tick sets its xw and out."""
    constant = "" if config.resident_input_size else " const"
    statements = []
    for ctype, name in instance_fields(config):
        chain = f"{name}_{config.instances - 1}"
        for i in range(config.instances - 2, -1, -1):
            chain = f"inst == {i} ? {name}_{i} : {chain}"
        statements.append(f"{ctype}{constant} {name} = {chain};")
    return " ".join(statements)


def render_source(config: KernelConfig, early_prefetch: bool | None = None) -> str:
    """The complete CUDA source of ``config``: generated prelude + template.
    ``early_prefetch`` overrides ``config.early_prefetch`` (False: the
    projections are copied after the pointwise update by every thread)."""
    spec = config.spec
    early_prefetch = config.early_prefetch if early_prefetch is None else early_prefetch
    defines = {
        "PRNN_H": config.hidden_size,
        "PRNN_G": spec.num_gates,
        "PRNN_NB": config.blocks,
        "PRNN_SYNC": SYNC_MODES.index(config.sync),
        "PRNN_THREADS": config.threads,
        "PRNN_WGS": config.group_size,
        "PRNN_BT": config.batch_tile,
        "PRNN_BP_ALIGN": config.batch_align,
        "PRNN_BP_PAD": config.batch_pad,
        "PRNN_U": config.units_per_block,
        "PRNN_KPT": config.k_per_thread,
        "PRNN_KPAD": config.padded_hidden,
        "PRNN_HBUFS": config.h_buffers,
        "PRNN_HAS_C": int(spec.has_cell_state),
        "PRNN_STAGES": spec.num_stages,
        "PRNN_IO_T": DEVICE_TYPES[config.dtype],
        "PRNN_MMA": int(config.math == "mma"),
        "PRNN_TF32": int(config.tf32),
        "PRNN_KS": config.k_split,
        "PRNN_KTW": config.k_tiles_per_warp,
        "PRNN_SHARED_W_FLOATS": config.shared_weight_floats,
        "PRNN_ONE_SYNC": int(config.one_sync),
        "PRNN_FIRST_STAGE": spec.num_stages - 1 if config.one_sync else 0,  # the first stage with an exchange
        "PRNN_C_RPW": max(config.column_rows_per_group, 1),
        "PRNN_CPT": max(config.column_chunks, 1),
        "PRNN_PROWS": config.partial_rows,
        "PRNN_BIAS_FLOATS": config.bias_floats,
        "PRNN_XW_DEPTH": config.prefetch_steps,
        "PRNN_EARLY_PREFETCH": int(early_prefetch),
        "PRNN_INSTANCES": config.instances,
        "PRNN_PIPELINE": int(config.pipeline),
        "PRNN_RELEASE_EVERY": PIPELINE_RELEASE_EVERY,
        "PRNN_LENGTHS": int(config.lengths),
        "PRNN_FUSED": int(config.fused_step),
        "PRNN_TEST_HOOK": int(config.test_hook),
        "PRNN_SAVE_GATES": int(config.save_gates),
        "PRNN_N_RPW": max(config.next_rows_per_group, 1),
        "PRNN_N_KREG": config.register_k,
        "PRNN_RESIDENT": int(config.resident_input_size > 0),
        "PRNN_I": config.resident_input_size,
        "PRNN_XW_ROWS": RESIDENT_PROJECTION_ROWS,
        "PRNN_TICK_WORDS": len(RESIDENT_TICK),
        "PRNN_CTL_TICK": RESIDENT_CONTROL.index(RESIDENT_TICK[0]),
        **{f"PRNN_CTL_{word.upper()}": i for i, word in enumerate(RESIDENT_CONTROL)},
        "PRNN_RESIDENT_PARAMS": _resident_params(config),
        "PRNN_TAGGED": int(config.tagged_exchange),
        "PRNN_READ_BATCH": TAGGED_READS_PER_THREAD,
        "PRNN_STEP_PROFILE": int(config.step_profile),
        "PRNN_PROFILE_PHASES": len(STEP_PROFILE_PHASES),
        **{f"PRNN_PHASE_{phase.upper()}": i for i, phase in enumerate(STEP_PROFILE_PHASES)},
        "PRNN_PROFILE_PARAMS": _profile_params(config),
        "PRNN_SLICE_SEQUENCES": config.slice_sequences,
        # The slice's sequence count, a kernel parameter a fixed-slice build ignores (B is a constant there).
        "PRNN_SLICE_PARAM": "slice_sequences" if config.slice_sequences else "B",
        "PRNN_INSTANCE_PARAMS": _instance_params(config),
        "PRNN_SELECT_INSTANCE": _select_instance(config),
    }
    first_gates = []
    for s, stage in enumerate(config.stages):
        defines[f"PRNN_S{s}_NG"] = len(stage)
        defines[f"PRNN_S{s}_RPW"] = config.rows_per_group(s)
        defines[f"PRNN_S{s}_KREG"] = config.register_k
        defines[f"PRNN_S{s}_MTW"] = config.m_tiles_per_warp(s)
        first_gates.append(spec.gates.index(stage[0]))
    # The stage gate lookup and the cell's math go after common.cuh (which
    # defines prnn_sigmoid etc.) and before the kernel that calls them.
    generated = [
        "__device__ __forceinline__ int prnn_stage_gate(int stage, int slot) {",
        "    return " + " : ".join(f"stage == {s} ? {g} + slot" for s, g in enumerate(first_gates[:-1]))
        + (" : " if len(first_gates) > 1 else "") + f"{first_gates[-1]} + slot;",
        "}",
        render_pointwise_functions(spec),
    ]
    return runtime.render_template("recurrence.cu", title=str(config), defines=defines, marker="// ---- kernel ----",
                                   generated="\n".join(generated) + "\n", keep_marker=True,
                                   includes=("common.cuh", "group_product.cuh"))


@functools.lru_cache(maxsize=256)
def compile_config(config: KernelConfig, arch: str | None = None) -> runtime.CompiledBinary:
    """Compile ``config`` (disk-cached) and check that it keeps weights on chip.

    Where the build with ``config.early_prefetch`` spills, the build
    without it is used. Raises :class:`ConfigError` if ptxas put anything in
    local memory: a spilled weight array runs at DRAM speed and defeats the
    kernel.
    """
    binary = runtime.compile_source("recurrence", render_source(config), arch=arch)
    res = binary.kernel_resources(KERNEL_NAME)
    if res.uses_local_memory and config.early_prefetch:
        # The idle warps' copies keep a few more values live through the update; at the register limit the
        # build without them (as before them) may still fit.
        binary = runtime.compile_source("recurrence", render_source(config, early_prefetch=False), arch=arch)
        res = binary.kernel_resources(KERNEL_NAME)
    if res.uses_local_memory:
        raise ConfigError(
            f"{config} spills to local memory ({res.registers} registers, {res.stack_frame_bytes} bytes stack, "
            f"{res.spill_store_bytes} bytes spill stores); it needs fewer register weights per thread "
            f"(now {config.register_weights})"
        )
    return binary
