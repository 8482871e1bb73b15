"""GPU tests of the runtime and the sync kernels: launches of every kind on
torch's stream, exact results of every exchange, residency checks, and
bounded spins that fail instead of hanging."""

import time

import pytest

from persistrnn import KernelLaunchError, runtime
from persistrnn.bench import sync

pytestmark = pytest.mark.gpu

BLOCK = sync.BLOCK


@pytest.fixture(scope="module")
def torch():
    import torch

    return torch


@pytest.fixture(scope="module")
def binary():
    return sync.sync_binary()


@pytest.fixture
def status(torch):
    return torch.zeros(1, dtype=torch.int32, device="cuda")


def expected(torch, H, steps):
    return torch.tensor(sync.expected_state(H, steps), device="cuda")


def test_device_facts_are_read_from_the_device(torch):
    facts = runtime.device_facts()
    props = torch.cuda.get_device_properties(facts.index)
    assert facts.sm_count == props.multi_processor_count
    assert facts.arch == f"sm_{props.major}{props.minor}"
    assert facts.shared_per_block_optin > 48 * 1024
    assert facts.registers_per_sm >= 64 * 1024


def test_resources_match_driver(binary):
    k = runtime.get_kernel(binary, "cluster_exchange_stasync")
    assert k.kernel.attributes.num_regs == k.resources.registers
    assert k.kernel.attributes.local_size_bytes == 0


def WATCH(timeout_s=None):
    """The sync kernels' arguments after the status word: no report word (the
    tests read the status word), and the wait bound."""
    import numpy as np

    ns = runtime.wait_timeout_ns() if timeout_s is None else int(timeout_s * 1e9)
    return np.uint64(0), np.uint64(ns)


@pytest.mark.parametrize("H", [256, 1024, 4096])
@pytest.mark.parametrize("cluster", [2, 4, 8, 16])
@pytest.mark.parametrize("kernel", ["cluster_exchange_dsmem", "cluster_exchange_stasync"])
def test_cluster_exchange_is_exact(torch, binary, status, kernel, H, cluster):
    k = runtime.get_kernel(binary, kernel)
    steps = 101  # odd: the result ends in buffer 1
    out = torch.full((H,), float("nan"), device="cuda")
    cfg = k.config(cluster, BLOCK, shared=sync.exchange_shared_bytes(kernel, H), cluster=cluster)
    args = (out, H, steps, status, *WATCH()) if kernel.endswith("stasync") else (out, H, steps)
    runtime.launch(k, cfg, *runtime.kernel_args(*args))
    runtime.check_status(status, kernel)
    torch.testing.assert_close(out, expected(torch, H, steps), rtol=0, atol=0)


def test_dynamic_shared_above_48KB(torch, binary, status):
    # 2 * 8192 floats = 64 KB: needs the opt-in attribute.
    H, steps = 8192, 33
    k = runtime.get_kernel(binary, "cluster_exchange_stasync")
    out = torch.full((H,), float("nan"), device="cuda")
    cfg = k.config(2, BLOCK, shared=sync.exchange_shared_bytes("cluster_exchange_stasync", H), cluster=2)
    runtime.launch(k, cfg, *runtime.kernel_args(out, H, steps, status, *WATCH()))
    runtime.check_status(status, "cluster_exchange_stasync")
    torch.testing.assert_close(out, expected(torch, H, steps), rtol=0, atol=0)


@pytest.mark.parametrize("H", [1, 100, 333, 1000, 4096])
def test_grid_exchange_is_exact(torch, binary, status, H):
    k = runtime.get_kernel(binary, "grid_exchange")
    blocks = runtime.device_facts().sm_count
    for steps in (1, 64, 99):
        hbuf = torch.full((2 * H,), float("nan"), device="cuda")
        hbuf[:H] = torch.arange(H, dtype=torch.float32, device="cuda")
        counter = torch.zeros(1, dtype=torch.int32, device="cuda")
        runtime.launch(k, k.config(blocks, BLOCK, shared=4 * H, cooperative=True),
                       *runtime.kernel_args(hbuf, H, counter, steps, status, *WATCH()))
        runtime.check_status(status, "grid_exchange")
        final = hbuf[(steps & 1) * H : (steps & 1) * H + H]
        torch.testing.assert_close(final, expected(torch, H, steps), rtol=0, atol=0)
        assert int(counter.item()) == blocks * steps  # every block arrived at every step


def test_launch_follows_torch_current_stream(torch, binary, status):
    # Queue fill -> kernel -> copy on a side stream with no host sync between:
    # the copy sees the kernel's result only if the launch went on that stream.
    H, steps, cluster = 1024, 500, 8
    k = runtime.get_kernel(binary, "cluster_exchange_stasync")
    cfg = k.config(cluster, BLOCK, shared=sync.exchange_shared_bytes("cluster_exchange_stasync", H), cluster=cluster)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out = torch.empty(H, device="cuda")
        out.fill_(float("nan"))
        runtime.launch(k, cfg, *runtime.kernel_args(out, H, steps, status, *WATCH()))
        copy = out.clone()
    side.synchronize()
    torch.testing.assert_close(copy, expected(torch, H, steps), rtol=0, atol=0)


def test_cooperative_grid_too_large_is_refused(binary):
    k = runtime.get_kernel(binary, "grid_barrier_counter")
    resident = k.max_resident_blocks(BLOCK)
    assert resident >= runtime.device_facts().sm_count
    with pytest.raises(KernelLaunchError, match=rf"needs {resident + 1} blocks resident.*holds {resident}"):
        k.config(resident + 1, BLOCK, cooperative=True)


def test_too_many_clusters_are_refused(binary):
    k = runtime.get_kernel(binary, "cluster_barrier")
    resident = k.max_resident_clusters(16, BLOCK, 200 * 1024)
    assert resident >= 1
    with pytest.raises(KernelLaunchError, match=r"clusters of 16 blocks resident"):
        k.config(16 * (resident + 1), BLOCK, shared=200 * 1024, cluster=16)


def test_grid_barrier_without_residency_fails_instead_of_hanging(torch, status):
    # Launched plainly (not cooperatively) with 4x the blocks that fit: the
    # resident blocks wait for blocks that cannot start. The bounded spin
    # must end the kernel and report, well within a second at this timeout.
    k = runtime.get_kernel(sync.sync_binary(), "grid_barrier_counter")
    blocks = 4 * k.max_resident_blocks(1024)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    t0 = time.perf_counter()
    runtime.launch(k, k.config(blocks, 1024), *runtime.kernel_args(counter, 1000, status, *WATCH(0.05)))
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    with pytest.raises(KernelLaunchError, match="not all blocks were resident"):
        runtime.check_status(status, "grid_barrier_counter")
    assert elapsed < 10, f"the failing kernel took {elapsed:.1f} s to give up"
    assert int(status.item()) == 0  # check_status clears the word for the next launch


def test_bench_sync_smoke():
    # A short run of the whole suite: every stage runs and checks its result.
    result = sync.run(sync.SyncConfig(steps=200, repeats=1, warmup=1, launches=50), progress=False)
    assert result["max_cluster_size"] >= 8
    assert set(result["cluster_exchange_stasync"]) == set(sync.EXCHANGE_BLOCKS)
    assert set(result["cluster_exchange_stasync"][256]) == set(sync.STATE_SIZES)
    assert result["launch"]["graph_us"] > 0
    assert "| st.async + mbarrier |" in sync.format_table(result)


def test_cluster_larger_than_the_device_allows_is_refused(binary):
    k = runtime.get_kernel(binary, "cluster_barrier")
    largest = k.max_cluster_size(BLOCK)
    assert largest >= 8  # 8 is portable on every cluster-capable GPU
    k.config(largest, BLOCK, cluster=largest)
    with pytest.raises(KernelLaunchError, match=rf"clusters of {largest + 1} blocks exceed .* largest, {largest}"):
        k.config(largest + 1, BLOCK, cluster=largest + 1)
