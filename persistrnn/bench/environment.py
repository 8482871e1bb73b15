"""What every result file records (GPU, clocks, driver, CUDA, torch, cuDNN,
commit, date), and reading a saved result back (``--from-json``)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
from pathlib import Path
from typing import Any, Callable

from .. import __version__


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=cwd, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def commit(repo: Path) -> str:
    """The commit a run ran: PERSISTRNN_COMMIT where set (a copy of the tree
    whose .git is absent or older than its files, as on a remote GPU
    machine), else git's HEAD, marked when tracked files differ from it, so
    that a run never names a commit whose code it did not run."""
    named = os.environ.get("PERSISTRNN_COMMIT")
    if named:
        return named
    head = _run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo)
    if head != "unknown" and _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo):
        head += " with uncommitted changes"
    return head


def describe(env: dict[str, Any]) -> str:
    """Markdown bullet lines naming the GPU, clocks, versions, commit and date of ``env``."""
    smi = env.get("nvidia_smi", {})
    return "\n".join([
        f"- GPU: {env.get('gpu')}, driver {smi.get('driver_version')}, SM clock {smi.get('clocks.sm')} "
        f"(max {smi.get('clocks.max.sm')}), memory clock {smi.get('clocks.mem')}, power limit {smi.get('power.limit')}",
        f"- torch {env['torch']} (CUDA {env['cuda_runtime']}), cuDNN {env['cudnn']}, cuda.core {env['cuda_core']}, "
        f"NVRTC {env['nvrtc']}",
        f"- persistrnn {env['persistrnn']}, commit {env['commit']}, {env['date']}"
        + ("" if "native_replay" not in env else f", native replay {'on' if env['native_replay'] else 'off'}"),
    ])


def environment() -> dict[str, Any]:
    import torch

    repo = Path(__file__).resolve().parents[2]
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "persistrnn": __version__,
        "commit": commit(repo),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    }
    try:
        from cuda.core import __version__ as core_version

        info["cuda_core"] = core_version
    except ImportError:
        info["cuda_core"] = None
    from ..runtime import nvrtc_version

    info["nvrtc"] = ".".join(map(str, nvrtc_version()))
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        query = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu"
        fields = _run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader", "-i",
                       str(torch.cuda.current_device())])
        info["nvidia_smi"] = dict(zip(query.split(","), (f.strip() for f in fields.split(","))))
        from ..runtime import native

        # built (once per torch build) before anything is timed, so that no timing catches the Python path
        # of a library still compiling in the background
        info["native_replay"] = native.available(wait=True)
    return info


def parse_layer_case(text: str) -> tuple[str, int, int, str]:
    """A one-layer case as the layer suites' ``--case`` takes it:
    ``lstm:256:8[:bfloat16]`` -> (cell, hidden size, batch, dtype; float32
    unless given). An argparse type: a malformed one is a usage error that
    names the expected form."""
    from ..cells import CELLS
    from ..persistent import DTYPES

    parts = text.split(":")
    ok = (len(parts) in (3, 4) and parts[0] in CELLS and all(p.isdigit() and int(p) > 0 for p in parts[1:3])
          and (len(parts) == 3 or parts[3] in DTYPES))
    if not ok:
        raise argparse.ArgumentTypeError(f"expected a case as cell:hidden:batch[:dtype] with cell one of "
                                         f"{sorted(CELLS)} and dtype one of {DTYPES}, e.g. lstm:256:8:bfloat16, "
                                         f"got {text!r}")
    return parts[0], int(parts[1]), int(parts[2]), parts[3] if len(parts) == 4 else "float32"


def add_result_arguments(p: argparse.ArgumentParser) -> None:
    """A suite CLI's ``--json`` and ``--markdown`` outputs and ``--from-json``
    (:func:`run_or_load`)."""
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--from-json", type=Path, help="write the table and files of an earlier run's --json instead "
                                                  "of running (no GPU needed)")


def write_result(args: argparse.Namespace, result: dict[str, Any], text: str) -> None:
    """``result`` to ``--json`` and the table ``text`` to ``--markdown``
    (where given), and the table to stdout."""
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.markdown:
        args.markdown.write_text(text)
    print(text)


def load_result(path: Path, suite: str, p: argparse.ArgumentParser) -> dict[str, Any]:
    """A suite's saved ``--json`` result, for ``--from-json``; a parser error
    (exit 2) naming what was expected if it is unreadable or another suite's."""
    try:
        result = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        p.error(f"--from-json {path}: could not read it ({exc})")
    if not isinstance(result, dict) or result.get("suite") != suite or "cases" not in result:
        got = result.get("suite") if isinstance(result, dict) else type(result).__name__
        p.error(f"--from-json {path}: expected a {suite} result, got {got!r}")
    return result


def run_or_load(args: argparse.Namespace, p: argparse.ArgumentParser, suite: str,
                run: Callable[[Callable[[dict[str, Any]], None]], dict[str, Any]]) -> dict[str, Any]:
    """A suite CLI's result: ``--from-json``'s, or ``run(save)`` on the GPU,
    where ``save(result)`` writes ``--json`` (after each case, so a cut-off
    run keeps what it measured) and runs once more at the end."""
    if args.from_json:
        return load_result(args.from_json, suite, p)
    from ..runtime import require_gpu

    require_gpu()

    def save(result: dict[str, Any]) -> None:
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))

    result = run(save)
    save(result)
    return result
