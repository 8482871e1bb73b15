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
