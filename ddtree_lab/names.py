"""The project's vocabulary, defined once and torch-free, so the engine, the workbench, the bench CLI
and the notebooks agree on every name and limit without importing each other."""
from __future__ import annotations

METHODS = ("ar", "dflash", "ddtree")                            # AR, single-path DFlash, DDTree
STAGES = ("draft", "tree_build", "verify", "commit", "other")  # a round's stages, then everything else
ATTENTION_BACKENDS = ("sdpa", "triton", "flex", "invariant")    # verify attention: dense reference, kernel, flex,
#   and the batch-invariant target (kernels/batch_invariant.py: every budget and AR give a token the same bits)
MLA_BACKENDS = ("sdpa", "triton")  # an MLA target's: the dense reference and its kernel (mla.py)
ROUTING_MODELS = ("router", "uniform")  # an MoE target's declared routing, or "trace:<file>" (declared_routing.py)
DEFAULT_ROUTING = "uniform"  # a random MoE shape's, unless told (random router weights route to the same few experts)
ROUTING_SPEC = "router, uniform or trace:FILE (a routing dump: vLLM's, SGLang's, a recorder's per-token .pt)"
TRITON_BACKENDS = ("triton", "invariant")                      # the backends whose kernels need CUDA or the interpreter
MAX_BUDGET = 1024                                                # largest tree (nodes beyond the root)
AUTO = "auto"                                                    # budget="auto": chosen per round (auto_budget.py)
AUTO_CANDIDATES = (16, 32, 64, 128, 256)                         # what "auto" chooses among unless told
AUTO_MAX_CANDIDATES = 8  # budgets one "auto" may choose among: a captured round each, a lane each in its kernel's block
AUTO_MAX_EDGES = AUTO_MAX_CANDIDATES - 1  # its confidence bins' edges: the kernel reads them in that same block

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


def is_budget(value) -> bool:
    """The one rule for a tree budget: an integer (not a bool) in 1..MAX_BUDGET."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_BUDGET


def parse_budget(text):
    """A budget as a user writes it (command line, study file): an integer in 1..MAX_BUDGET, or "auto"."""
    if isinstance(text, str) and text.strip().lower() == AUTO:
        return AUTO
    if isinstance(text, bool) or (not isinstance(text, int) and not (isinstance(text, str) and text.strip().isdigit())):
        raise ValueError(f"{text!r} is neither an integer budget nor {AUTO!r}")
    if not is_budget(int(text)):
        raise ValueError(f"budget {int(text)} is out of range 1..{MAX_BUDGET}")
    return int(text)


def _argparse_type(parse):
    """A parser of one value as an argparse type: its ValueError becomes argparse's one line, before anything runs."""
    import argparse

    def parse_arg(text):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse_arg


def int_in(lo: int, hi: int | None = None, what: str = "value"):
    """An argparse type: an integer in lo..hi (hi None: no upper bound)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not an integer") from None
        if hi is None and value < lo:
            raise ValueError(f"{what} {value} must be at least {lo}")
        if hi is not None and not lo <= value <= hi:
            raise ValueError(f"{what} {value} is out of range {lo}..{hi}")
        return value
    return _argparse_type(parse)


budget_arg = _argparse_type(parse_budget)    # a command line's budget: an integer or "auto"
tree_budget_arg = int_in(1, MAX_BUDGET, "budget")      # an integer budget only (the benches that take no "auto")
positive_int = int_in(1, what="value")                  # counts: rounds, tokens, prompts, repeats
non_negative_int = int_in(0, what="value")


def routing_kind(routing: str | None) -> str:
    """router, uniform or trace, of a routing name a run records (None: the default's)."""
    return (routing or DEFAULT_ROUTING).split(":", 1)[0]


def recorded_routing(bench: dict) -> str:
    """The routing a bench JSON's MoE layers ran: its `routing` field; a file written before routing was declared
    ran the router's."""
    return bench.get("routing") or "router"
