"""Every kernel family compiles for sm_90 on a CPU-only machine, with no
spills and no local memory (a run-time index into a register array, or a
register budget blown, would show here before it shows as a slow kernel)."""

import pytest

from persistrnn.bench import sync

SYNC_KERNELS = {
    "empty_kernel",
    "grid_sync_cg",
    "grid_barrier_counter",
    "grid_exchange",
    "cluster_barrier",
    "cluster_exchange_dsmem",
    "cluster_exchange_stasync",
}


@pytest.fixture(scope="module")
def sync_binary():
    return sync.sync_binary(arch="sm_90")


def test_sync_kernels_all_present(sync_binary):
    assert set(sync_binary.resources) == SYNC_KERNELS


@pytest.mark.parametrize("kernel", sorted(SYNC_KERNELS))
def test_sync_kernel_has_no_local_memory(sync_binary, kernel):
    res = sync_binary.kernel_resources(kernel)
    assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0, res
    assert res.stack_frame_bytes == 0, res


def _ptx(source: str) -> str:
    # NVRTC through cuda.bindings: cuda.core's PTX target asks the driver for
    # its version, and CI has no driver.
    from cuda.bindings import nvrtc

    from persistrnn import runtime

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"sync_bench.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    opts = runtime.program_options("sm_90", {}).as_bytes("nvrtc")
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    err, size = nvrtc.nvrtcGetPTXSize(prog)
    buf = b" " * size
    (err,) = nvrtc.nvrtcGetPTX(prog, buf)
    return buf.decode()


def test_sync_exchange_uses_hopper_instructions():
    # The st.async path is the point of the kernel: make sure it is there.
    from persistrnn import runtime

    text = _ptx(runtime.read_source("sync_bench.cu"))
    assert "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32" in text
    assert "mbarrier.try_wait.parity.acquire.cluster" in text
    assert "barrier.cluster.arrive.release" in text


def test_expected_state_matches_recurrence():
    H, S = 12, 30
    h = [float(j) for j in range(H)]
    for _ in range(S):
        h = [h[(j + 1) % H] + 1.0 for j in range(H)]
    assert sync.expected_state(H, S) == h
