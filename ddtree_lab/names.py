"""The project's vocabulary, defined once and torch-free, so the engine, the workbench, the bench CLI
and the notebooks agree on every name and limit without importing each other."""
from __future__ import annotations

METHODS = ("ar", "dflash", "ddtree")                            # AR, single-path DFlash, DDTree
STAGES = ("draft", "tree_build", "verify", "commit", "other")  # a round's stages, then everything else
ATTENTION_BACKENDS = ("sdpa", "triton", "flex", "invariant")    # verify attention: dense reference, kernel, flex,
#   and the batch-invariant target (kernels/batch_invariant.py: every budget and AR give a token the same bits)
TRITON_BACKENDS = ("triton", "invariant")                      # the backends whose kernels need CUDA or the interpreter
MAX_BUDGET = 1024                                                # largest tree (nodes beyond the root)
AUTO = "auto"                                                    # budget="auto": chosen per round (auto_budget.py)
AUTO_CANDIDATES = (16, 32, 64, 128, 256)                         # what "auto" chooses among unless told

# dtype spellings a user may write -> the canonical name (torch.<name>)
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
               "bfloat16": "bfloat16", "bf16": "bfloat16"}
STUDY_DTYPES = ("float32", "bfloat16", "float16")  # what a study file may name (canonical only)

# what a study writes (outputs/<study>/...)
STUDY_FILE = "study.json"
RUN_FILE = "run.json"
RESULTS_FILE = "results.json"
TRACES_FILE = "traces.jsonl"
REPORT_FILE = "report.html"
TIMELINE_FILE = "timeline.json"
MICROBENCH_FILE = "microbench.json"


def topk_width(topk: int | None, budget: int, vocab: int) -> int:
    """K, the tokens kept per depth: `topk` when given (0 and None both mean "as many as the budget"),
    never more than the budget or the vocabulary."""
    return min(topk or budget, budget, vocab)


def parse_budget(text):
    """A budget as a user writes it (command line, study file): an integer, or "auto"."""
    if isinstance(text, str) and text.strip().lower() == AUTO:
        return AUTO
    if isinstance(text, bool) or (not isinstance(text, int) and not (isinstance(text, str) and text.strip().isdigit())):
        raise ValueError(f"{text!r} is neither an integer budget nor {AUTO!r}")
    return int(text)


def budget_arg(text: str):
    """parse_budget for a command line's argument: its error becomes argparse's one line."""
    import argparse

    try:
        return parse_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
