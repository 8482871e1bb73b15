"""Data-parallel training over persistrnn modules (examples/train_ddp.py):
DDP's averaged gradients give the same parameters as one process on the
whole global batch, to fp32 rounding."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [1, 2])
def test_ddp_training_matches_one_process_on_the_global_batch(ranks):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                          str(ROOT / "examples" / "train_ddp.py")], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["world_size"] == ranks
    assert result["largest_relative_difference"] <= 1e-6, result


def test_the_overlap_profile_measures_intersections_of_unions_of_intervals():
    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_ddp", ROOT / "scripts" / "profile_ddp.py")
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    assert profile.merged([(5, 7), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 7)]
    # all-reduce kernels [0, 4) and [10, 12); compute [2, 6) and [3, 11): 2 + 1 overlapped, counted once
    assert profile.overlap([(0, 4), (10, 12)], [(2, 6), (3, 11)]) == 3
    assert profile.overlap([(0, 1)], [(1, 2)]) == 0 and profile.overlap([], [(0, 1)]) == 0
