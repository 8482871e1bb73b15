"""The ONNX models of the import issue's speed targets, written to a folder:
``gru256.onnx`` (the canonical GRU, ONNX's default ``linear_before_reset=0``,
which ONNX Runtime's CUDA provider runs on the CPU) and ``lstm256.onnx``,
hidden 256, input 256, random weights (torch's initialisation, seed 0): one
ONNX GRU or LSTM node from ``X`` to ``Y`` and ``Y_h``, as an exported model
holds it (``persistrnn.bench.onnx_peer.build_node_model``).
``python -m persistrnn onnx FILE --batch B --steps 100`` then converts one,
says what runs where and, on a GPU, times it against ONNX Runtime.

    PYTHONPATH=. python scripts/onnx_models.py OUT_DIR
"""

import sys
from pathlib import Path

import torch

from persistrnn import reference
from persistrnn.bench import onnx_peer

MODELS = {"gru256": ("gru_reset_before", torch.nn.GRU), "lstm256": ("lstm", torch.nn.LSTM)}
HIDDEN = 256


def write(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (cell, module) in MODELS.items():
        torch.manual_seed(0)
        params = reference.params_from_torch(module(HIDDEN, HIDDEN))  # the canonical GRU has the same layout
        path = folder / f"{name}.onnx"
        path.write_bytes(onnx_peer.build_node_model(cell, params, HIDDEN, HIDDEN))
        written.append(path)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__.strip().splitlines()[-1].strip())
    for path in write(Path(sys.argv[1])):
        print(f"wrote {path}")
