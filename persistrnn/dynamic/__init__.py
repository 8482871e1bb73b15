"""Dynamic networks in one persistent interpreter kernel (VPPS).

Declare the parameters once (:class:`Model`), build each batch's
computation graphs with the expression API (:class:`Graph`, or the ready
builders :class:`TreeLSTM` and :class:`BiLSTMTagger`), schedule them into one
script per virtual processor (:func:`schedule`; ahead of the kernel, in
worker processes: :func:`script_loader`), and run the script: on the
GPU in one launch (:class:`Interpreter`: forward, backward and the optimiser
update, or forward only), or on the CPU in float64 (:func:`run_script`).
"""

from .builders import BiLSTMTagger, TreeLSTM
from .data import DATA_DIR, Tree, Vocabulary, parse_tree, read_sst, read_wikiner
from .graph import Expr, Graph
from .interpreter import Result, run_script
from .kernel import Interpreter, KernelSpec, compile_spec, kernel_layout, profile_table, render_source
from .loader import script_loader
from .model import Model, Parameter
from .optimizers import SGD, Adam
from .script import PLACEMENTS, MatrixLayout, Script, matrix_layout, schedule

__all__ = ["Adam", "BiLSTMTagger", "DATA_DIR", "Expr", "Graph", "Interpreter", "KernelSpec", "MatrixLayout", "Model",
           "PLACEMENTS", "Parameter", "Result", "SGD", "Script", "Tree", "TreeLSTM", "Vocabulary", "compile_spec",
           "kernel_layout", "matrix_layout", "parse_tree", "profile_table", "read_sst", "read_wikiner", "render_source",
           "run_script", "schedule", "script_loader"]
