"""A study's runs: their parameters (the notebooks' torch-free contract), names and the grid.

Every notebook receives a RunParams as flat papermill parameters and rebuilds it with
`RunParams.from_namespace(globals())`; a run's name says its point of the grid (`ar-t0`,
`dflash-t0`, `ddtree-b64-k0-t0`, `ddtree-auto-k0-t0`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from .. import pairs
from ..environment import REPO_DIR
from ..names import AUTO, AUTO_CANDIDATES, METHODS, RUN_FILE
from ..prompts import resolve_prompt_set
from .spec import Study


@dataclass
class RunParams:
    """Everything a notebook needs; flat scalars so papermill can inject them."""
    study_name: str = "interactive"
    study_dir: str = ""           # "" -> outputs/<study_name> under the repository
    run_name: str = "ddtree-b32-k0-t0"
    run_dir: str = ""             # "" -> <study_dir>/<run_name>; the study runner passes "."
    pair: str = "lab"
    target_dir: str = ""
    drafter_dir: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    attention: str = "sdpa"
    compile: bool = False
    routing: str = ""             # an MoE target's routing spec ("": the pair's default; routing_dumps.routing_model)
    prompt_set: str = "lab:code"
    n_prompts: int = 2
    method: str = "ddtree"
    budget: int | str = 32        # ddtree only; 0 for ar/dflash; "auto": chosen per round (auto_candidates)
    topk: int = 0                 # 0 -> K = budget
    temperature: float = 0.0
    max_new_tokens: int = 32
    seed: int = 0
    warmup: bool = True
    repeats: int = 3              # timed passes over the prompt set (median and spread recorded)
    budgets: list = field(default_factory=list)  # the study's integer ddtree budgets (per-study notebooks)

    @classmethod
    def from_namespace(cls, ns: dict) -> "RunParams":
        """Pick the fields from a notebook's globals() after papermill injected parameters."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in ns.items() if k in names})

    def resolved(self) -> "RunParams":
        """Fill empty dirs for interactive use: outputs/<study>/<run> under the repository."""
        study_dir = self.study_dir or str(REPO_DIR / "outputs" / self.study_name)
        run_dir = self.run_dir or str(Path(study_dir) / self.run_name)
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        return dataclasses.replace(self, study_dir=study_dir, run_dir=run_dir)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        d = self.to_json()
        for k in ("run_dir", "study_dir"):  # where it lives does not change what it computes
            d.pop(k)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- what a run read
def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _safetensors_digest(path: Path) -> str:
    """Size + the header (every tensor's name, dtype, shape and offsets): cheap, and it changes with any
    re-save; a same-size in-place edit of tensor bytes alone is not seen (docs/workbench.md)."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        header = f.read(min(n, 100 << 20))
    return _sha(f"{path.stat().st_size}:".encode() + head + header)


def checkpoint_digests(directory: str | Path, label: str) -> dict[str, str]:
    """{label/file: digest} for what loading a checkpoint dir reads: its JSON files (config, tokenizer,
    index) by content, its weight files by size + header."""
    d, out = Path(directory), {}
    if not d.is_dir():
        return {label: "missing"}
    for p in sorted(d.iterdir()):
        if p.suffix == ".json" and p.is_file():
            out[f"{label}/{p.name}"] = _sha(p.read_bytes())
        elif p.suffix == ".safetensors" and p.is_file():
            out[f"{label}/{p.name}"] = _safetensors_digest(p)
    return out


def input_digests(params: "RunParams", notebooks=()) -> dict[str, str]:
    """Digests of everything a run reads besides its parameters: the prompt-set file, the checkpoint
    directories and the notebooks it executes. Part of a run's fingerprint, so an edit in place reruns it."""
    out: dict[str, str] = {}
    prompts = resolve_prompt_set(params.prompt_set)
    out["prompts"] = _sha(prompts.read_bytes()) if prompts is not None else "missing"
    dirs: tuple = ()
    if params.pair and not params.pair.startswith(pairs.RANDOM_PREFIX):  # random weights come from the seed
        try:
            dirs = pairs.resolve(params.pair)
        except ValueError:
            out["pair"] = "unresolved"
    elif not params.pair:
        dirs = tuple(x for x in (params.target_dir, params.drafter_dir) if x)
    for label, d in zip(("target", "drafter"), dirs):
        if d:
            out.update(checkpoint_digests(d, label))
    for nb in notebooks:
        out[f"notebook/{Path(nb).name}"] = _sha(Path(nb).read_bytes())
    return out


def run_fingerprint(params: "RunParams", inputs: dict[str, str]) -> str:
    """The fingerprint a study records for a run: its parameters and the digests of what it read."""
    blob = json.dumps([params.fingerprint(), inputs], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def changed_inputs(old: dict | None, new: dict[str, str]) -> list[str]:
    """The input names whose digest differs (for the log line of a rerun)."""
    old = old or {}
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def is_fixed(budget) -> bool:
    """An integer budget, as figures and fits need; "auto" (chosen per round) is not one."""
    return isinstance(budget, int) and not isinstance(budget, bool)


def fixed_budgets(budgets) -> list[int]:
    """The integer budgets of a grid's list, sorted and distinct."""
    return sorted({b for b in budgets if is_fixed(b)})


def auto_candidates(params: "RunParams") -> tuple[int, ...]:
    """What an `auto` run chooses among: the study's integer budgets, or AUTO_CANDIDATES without any."""
    return tuple(fixed_budgets(params.budgets)) or AUTO_CANDIDATES


def _fmt_t(t: float) -> str:
    return f"{t:g}"


def run_name(method: str, budget: int | str | None = None, topk: int | None = None, temperature: float = 0.0) -> str:
    if method == "ddtree" and budget == AUTO:
        return f"ddtree-auto-k{topk or 0}-t{_fmt_t(temperature)}"
    if method == "ddtree":
        return f"ddtree-b{budget}-k{topk or 0}-t{_fmt_t(temperature)}"
    return f"{method}-t{_fmt_t(temperature)}"


def base_params(study: Study, study_dir: Path) -> dict:
    m = study.models
    return dict(study_name=study.name, study_dir=str(study_dir), pair=m.pair or "",
                target_dir=m.target or "", drafter_dir=m.drafter or "", device=m.device,
                dtype=m.dtype, attention=m.attention, compile=m.compile, routing=m.routing,
                prompt_set=study.prompts.set,
                n_prompts=study.prompts.n_prompts, max_new_tokens=study.grid.max_new_tokens,
                seed=study.grid.seed, warmup=study.warmup, repeats=study.grid.repeats,
                budgets=fixed_budgets(study.grid.budget))


def expand_grid(study: Study, study_dir: Path | str = ".") -> list[RunParams]:
    """All runs in execution order: AR first (the reference), then DFlash, then DDTree by budget, `auto` last."""
    base = base_params(study, Path(study_dir))
    runs: list[RunParams] = []
    seen: set = set()
    for meth in [m for m in METHODS if m in study.methods]:
        for t in study.grid.temperature:
            points = [(0, 0)]
            if meth == "ddtree":
                budgets = fixed_budgets(study.grid.budget) + [AUTO] * (AUTO in study.grid.budget)
                points = [(b, k or 0) for b in budgets for k in study.grid.topk]
            for b, k in points:
                widest = max(base["budgets"] or AUTO_CANDIDATES) if b == AUTO else b
                k_eff = 0 if (k == 0 or k >= widest) else k  # topk >= budget is the same tree as K = budget
                key = (meth, b, k_eff, t)
                if key in seen:
                    continue
                seen.add(key)
                runs.append(RunParams(**base, run_name=run_name(meth, b, k_eff, t), run_dir=".",
                                      method=meth, budget=b, topk=k_eff, temperature=t))
    return runs


def study_params(study: Study, study_dir: Path, notebook: str) -> RunParams:
    """Parameters for a once-per-study notebook: it profiles / summarises a middle budget."""
    base = base_params(study, study_dir)
    budgets = base["budgets"]
    mid = budgets[len(budgets) // 2] if budgets else 32
    return RunParams(**base, run_name=Path(notebook).stem, run_dir=".", method="ddtree", budget=mid,
                     topk=0, temperature=study.grid.temperature[0])




def read_run_status(run_dir: Path) -> dict | None:
    """A run directory's run.json, or None when it is absent or unreadable."""
    try:
        st = json.loads((Path(run_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return st if isinstance(st, dict) else None
