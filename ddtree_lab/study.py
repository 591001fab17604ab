"""Studies: a YAML file -> validated `Study` -> grid of runs -> papermill executions -> report.

    ddtree-lab study params/quickstart.yaml [--out DIR]

A study file is refused *before anything runs* if any key is unknown, mistyped or out of range,
or if a notebook, model directory or prompt set is missing; the message names the field
(`grid.budget[2]: 2048 is out of range 1..1024`). See docs/workbench.md for the schema.

Each grid point is a run with a stable name (`ar-t0`, `dflash-t0`, `ddtree-b64-k0-t0`) and its own
directory `<study_dir>/<run>/` holding the executed notebooks, `results.json`, `traces.jsonl`,
`figures/` and `run.json` (status, fingerprint, error). Runs are built in a temp directory and
renamed into place, so a directory is either a finished run, a recorded failure or absent.
This module imports no torch: the CLI stays fast and validation is cheap.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .atomic import atomic_dir, atomic_write_json, atomic_write_text, clean_stale_temps

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
METHODS = ("ar", "dflash", "ddtree")
DEVICES = re.compile(r"^(cpu|cuda|cuda:\d+|auto)$")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTIONS = ("sdpa", "triton", "flex")
PAIR_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]*$")
SHIPPED_SET = re.compile(r"^([A-Za-z0-9_]+):([A-Za-z0-9_.\-]+)$")  # <pair>:<set>, e.g. lab:code
STUDY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
BUDGET_RANGE = (1, 1024)
KERNEL = "python3"
REPORT_FILE = "report.html"


class StudyError(ValueError):
    """A refused study file; `field` is the dotted key path that is wrong."""

    def __init__(self, field: str, message: str, source: str | None = None):
        self.field, self.source = field, source
        where = f"study file {source}: " if source else ""
        super().__init__(f"{where}{field}: {message}" if field else f"{where}{message}")


# ----------------------------------------------------------------------------- schema
@dataclass
class ModelsSpec:
    pair: str | None = "lab"      # "lab", "random:<shape>" or None when target/drafter are given
    target: str | None = None     # target checkpoint dir (HF layout); relative to the study file
    drafter: str | None = None    # DFlash drafter checkpoint dir
    device: str = "cpu"           # cpu | cuda | cuda:N | auto
    dtype: str = "float32"        # float32 | bfloat16 | float16
    attention: str = "sdpa"       # verify attention: sdpa | triton | flex
    compile: bool = False         # fuse each layer's elementwise work (torch.compile; slower first call)


@dataclass
class PromptsSpec:
    set: str = "lab:code"         # "lab:<name>" (shipped with the lab pair) or a .jsonl path
    n_prompts: int = 4            # first n prompts of the set


@dataclass
class GridSpec:
    budget: list[int] = field(default_factory=lambda: [16, 32, 64])
    topk: list[int | None] = field(default_factory=lambda: [None])  # None/0 -> K = budget
    temperature: list[float] = field(default_factory=lambda: [0.0])
    max_new_tokens: int = 64
    seed: int = 0


@dataclass
class NotebooksSpec:
    per_run: list[str] = field(default_factory=lambda: ["accepted_paths"])  # first one generates
    per_study: list[str] = field(default_factory=lambda: ["budget_sweep"])
    report: str = "findings_report"
    timeout: int = 3600           # seconds per cell before the run is recorded as failed


@dataclass
class Study:
    name: str
    models: ModelsSpec
    prompts: PromptsSpec
    methods: list[str]
    grid: GridSpec
    notebooks: NotebooksSpec
    report: bool = True
    description: str = ""
    warmup: bool = True           # one short untimed generate before timing (kernels, caches)
    external: list[str] = field(default_factory=list)  # serving-benchmark result files/folders for the report
    path: Path | None = None      # the study file (paths inside are relative to its directory)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["path"] = str(self.path) if self.path else None
        return d


# The allowed keys, with their types, per section. A type is a tuple of accepted Python types.
_SECTIONS: dict[str, dict[str, Any]] = {
    "": {"name": str, "description": str, "models": dict, "prompts": dict, "methods": list,
         "grid": dict, "notebooks": dict, "report": bool, "warmup": bool, "external": list},
    "models": {"pair": (str, type(None)), "target": (str, type(None)),
               "drafter": (str, type(None)), "device": str, "dtype": str, "attention": str,
               "compile": bool},
    "prompts": {"set": str, "n_prompts": int},
    "grid": {"budget": list, "topk": list, "temperature": list, "max_new_tokens": int, "seed": int},
    "notebooks": {"per_run": list, "per_study": list, "report": str, "timeout": int},
}
_REQUIRED = {"": ("name", "models", "prompts", "methods", "grid")}


def _type_name(t) -> str:
    ts = t if isinstance(t, tuple) else (t,)
    names = {str: "a string", int: "an integer", float: "a number", bool: "true/false",
             list: "a list", dict: "a mapping", type(None): "null"}
    return " or ".join(names.get(x, x.__name__) for x in ts)


def _is(value, t) -> bool:
    ts = t if isinstance(t, tuple) else (t,)
    if isinstance(value, bool) and bool not in ts:
        return False  # YAML `yes` is a bool, never an int
    if float in ts and isinstance(value, int):
        return True
    return isinstance(value, ts)


def _check_keys(section: str, data: Any, src: str) -> dict:
    if not isinstance(data, dict):
        raise StudyError(section or "(top level)", f"must be a mapping, got {_type_name(type(data))}", src)
    allowed = _SECTIONS[section]
    for key, value in data.items():
        path = f"{section}.{key}" if section else str(key)
        if key not in allowed:
            hint = difflib.get_close_matches(str(key), list(allowed), n=1)
            extra = f"; did you mean '{hint[0]}'?" if hint else ""
            raise StudyError(path, f"unknown key (allowed: {', '.join(allowed)}){extra}", src)
        want = allowed[key]
        if want is list and not isinstance(value, list):
            continue  # scalars are promoted to one-element lists by the caller
        if not _is(value, want):
            raise StudyError(path, f"must be {_type_name(want)}, got {value!r}", src)
    for key in _REQUIRED.get(section, ()):
        if key not in data:
            raise StudyError(f"{section}.{key}" if section else key, "is required", src)
    return data


def _as_list(path: str, value, item_type, src: str, allow_none: bool = False) -> list:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise StudyError(path, "must not be empty", src)
    for i, v in enumerate(items):
        if v is None and allow_none:
            continue
        if not _is(v, item_type):
            raise StudyError(f"{path}[{i}]", f"must be {_type_name(item_type)}, got {v!r}", src)
    return items


def _resolve_path(p: str, base: Path | None) -> Path:
    path = Path(os.path.expanduser(p))
    if not path.is_absolute() and base is not None and (base / path).exists():
        return (base / path).resolve()
    return path.resolve()


# ----------------------------------------------------------------------------- lookups
def notebook_dirs(base: Path | None = None) -> list[Path]:
    dirs = [REPO_DIR / "notebooks", PACKAGE_DIR / "notebooks", Path.cwd() / "notebooks"]
    if base is not None:
        dirs.insert(0, base / "notebooks")
    return list(dict.fromkeys(dirs))


def find_notebook(name: str, base: Path | None = None) -> Path | None:
    """A shipped notebook by name (`budget_sweep`) or a path to an .ipynb."""
    if name.endswith(".ipynb") or "/" in name:
        p = _resolve_path(name, base)
        return p if p.is_file() else None
    for d in notebook_dirs(base):
        p = d / f"{name}.ipynb"
        if p.is_file():
            return p.resolve()
    return None


def prompt_dir(pair_name: str) -> Path:
    """Prompt sets shipped with a pair: ddtree_lab/lab_pair/prompts, ddtree_lab/<name>/prompts."""
    return PACKAGE_DIR / ("lab_pair" if pair_name == "lab" else pair_name) / "prompts"


def resolve_prompt_set(spec: str, base: Path | None = None) -> Path | None:
    """`lab:code` -> ddtree_lab/lab_pair/prompts/code.jsonl (likewise `<pair>:<set>` for other
    shipped pairs); anything else is a .jsonl path (relative to the study file or the cwd)."""
    m = SHIPPED_SET.match(spec)
    if m:
        p = prompt_dir(m.group(1)) / f"{m.group(2)}.jsonl"
        return p if p.is_file() else None
    p = _resolve_path(spec, base)
    return p if p.is_file() else None


def available_prompt_sets() -> list[str]:
    out = []
    for d in sorted(PACKAGE_DIR.glob("*/prompts")):
        name = "lab" if d.parent.name == "lab_pair" else d.parent.name
        out += [f"{name}:{p.stem}" for p in sorted(d.glob("*.jsonl"))]
    return out


def _is_chat(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(m, dict) and "content" in m for m in x)


def load_prompts(spec: str, n_prompts: int | None = None, base: Path | None = None) -> list[dict]:
    """Read a prompt set: a list of {"id", "prompt"}. A line holds "prompt" (text) or "messages"
    (chat messages, rendered by the engine with the checkpoint's chat template); ids default to
    the line number."""
    path = resolve_prompt_set(spec, base)
    if path is None:
        raise FileNotFoundError(f"prompt set not found: {spec}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            row = json.loads(line)
            row = row if isinstance(row, dict) else {}
            prompt = row.get("prompt", row.get("messages"))
            if not (_is_chat(prompt) or (isinstance(prompt, str) and "prompt" in row)):
                raise ValueError(f"{path}:{i + 1}: each line must be an object with a string 'prompt' "
                                 "or a list of chat 'messages'")
            rows.append({"id": str(row.get("id", len(rows))), "prompt": prompt})
    return rows[:n_prompts] if n_prompts else rows


def prompt_text(prompt) -> str:
    """Display text of a prompt: the text, or the last chat message's content."""
    return prompt if isinstance(prompt, str) else str(prompt[-1].get("content", "")) if prompt else ""


def register_pair_module(name: str) -> None:
    """Named pairs register themselves when their module (ddtree_lab.<name>) is imported."""
    import importlib
    if re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name) and name not in ("lab", "random"):
        try:
            importlib.import_module(f"{__package__}.{name}")
        except ImportError:
            pass


def _lab_pair_present() -> bool:
    # The lab pair ships as checkpoint dirs ddtree_lab/lab_pair/{target,drafter}.
    d = PACKAGE_DIR / "lab_pair"
    return (d / "target" / "config.json").is_file() and (d / "drafter" / "config.json").is_file()


def _check_named_pair(name: str, src: str | None) -> None:
    try:
        from . import registry  # pulled checkpoints registered by name (imports torch)
        register_pair_module(name)
        registry.resolve(name)
    except ImportError:
        return
    except Exception as e:  # noqa: BLE001 - any resolution failure refuses the study
        raise StudyError("models.pair", str(e), src) from None


def _check_model_dir(path: str, field_name: str, base: Path | None, src: str) -> str:
    p = _resolve_path(path, base)
    if not p.is_dir():
        raise StudyError(field_name, f"directory not found: {p}", src)
    if not (p / "config.json").is_file():
        raise StudyError(field_name, f"no config.json in {p} (expected a Hugging Face checkpoint dir)", src)
    return str(p)


# ----------------------------------------------------------------------------- load + validate
def parse_study(data: Any, path: Path | None = None, check_files: bool = True) -> Study:
    """Validate a parsed study mapping; raise StudyError naming the first bad field."""
    src = str(path) if path else None
    base = path.parent if path else None
    if data is None:
        raise StudyError("", "the file is empty", src)
    _check_keys("", data, src)

    name = data["name"]
    if not STUDY_NAME.match(name):
        raise StudyError("name", f"{name!r} must be letters, digits, '_', '-', '.' (it names a directory)", src)

    m = _check_keys("models", data["models"], src)
    models = ModelsSpec(**{**dataclasses.asdict(ModelsSpec()), **m})
    if m.get("target") or m.get("drafter"):
        if "pair" not in m:
            models.pair = None
        if models.pair is not None:
            raise StudyError("models.pair", "give either pair or target/drafter, not both", src)
        for key in ("target", "drafter"):
            if not getattr(models, key):
                raise StudyError(f"models.{key}", "is required when the other checkpoint dir is given", src)
            if check_files:
                setattr(models, key, _check_model_dir(getattr(models, key), f"models.{key}", base, src))
    elif models.pair is None:
        raise StudyError("models", "needs pair: lab (or random:<shape>) or both target and drafter", src)
    elif not PAIR_NAME.match(models.pair):
        raise StudyError("models.pair", f"{models.pair!r} is not 'lab', 'random:<shape>' or a target/drafter pair", src)
    elif check_files and models.pair == "lab" and not _lab_pair_present():
        raise StudyError("models.pair", "the embedded lab pair is not installed (ddtree_lab/lab_pair has no checkpoints)", src)
    elif check_files and models.pair.startswith("random:"):
        try:
            from .bench import RANDOM_SHAPES
        except ImportError:
            RANDOM_SHAPES = None
        if RANDOM_SHAPES is not None and models.pair[7:] not in RANDOM_SHAPES:
            raise StudyError("models.pair", f"unknown random shape {models.pair[7:]!r} "
                             f"(known: {', '.join('random:' + k for k in RANDOM_SHAPES)})", src)
    elif check_files and models.pair != "lab":
        _check_named_pair(models.pair, src)
    if not DEVICES.match(models.device):
        raise StudyError("models.device", f"{models.device!r} must be cpu, cuda, cuda:N or auto", src)
    if check_files and models.device.startswith("cuda"):
        import torch  # every run would fail: refuse now
        if not torch.cuda.is_available():
            raise StudyError("models.device", f"{models.device!r} requested but no CUDA device is visible", src)
        if ":" in models.device and int(models.device.split(":")[1]) >= torch.cuda.device_count():
            raise StudyError("models.device", f"{models.device!r}: only {torch.cuda.device_count()} CUDA device(s)", src)
    if models.dtype not in DTYPES:
        raise StudyError("models.dtype", f"{models.dtype!r} must be one of {', '.join(DTYPES)}", src)
    if models.attention not in ATTENTIONS:
        raise StudyError("models.attention", f"{models.attention!r} must be one of {', '.join(ATTENTIONS)}", src)

    p = _check_keys("prompts", data["prompts"], src)
    prompts = PromptsSpec(**{**dataclasses.asdict(PromptsSpec()), **p})
    if prompts.n_prompts < 1:
        raise StudyError("prompts.n_prompts", f"{prompts.n_prompts} must be at least 1", src)
    if check_files:
        resolved = resolve_prompt_set(prompts.set, base)
        if resolved is None:
            known = ", ".join(available_prompt_sets()) or "none installed"
            raise StudyError("prompts.set", f"prompt set {prompts.set!r} not found (shipped sets: {known})", src)
        try:
            rows = load_prompts(prompts.set, None, base)
        except (ValueError, json.JSONDecodeError) as e:
            raise StudyError("prompts.set", f"unreadable prompt file: {e}", src) from None
        if len(rows) < prompts.n_prompts:
            raise StudyError("prompts.n_prompts", f"{prompts.n_prompts} requested but {prompts.set} has {len(rows)}", src)
        if not SHIPPED_SET.match(prompts.set):
            prompts.set = str(resolved)  # notebooks run in another cwd: pass an absolute path

    methods = _as_list("methods", data["methods"], str, src)
    for i, meth in enumerate(methods):
        if meth not in METHODS:
            raise StudyError(f"methods[{i}]", f"{meth!r} must be one of {', '.join(METHODS)}", src)
    if len(set(methods)) != len(methods):
        raise StudyError("methods", "lists a method twice", src)

    g = _check_keys("grid", data["grid"], src)
    grid = GridSpec()
    if "budget" in g:
        grid.budget = _as_list("grid.budget", g["budget"], int, src)
    elif "ddtree" in methods:
        raise StudyError("grid.budget", "is required when methods include ddtree", src)
    for i, b in enumerate(grid.budget):
        if not BUDGET_RANGE[0] <= b <= BUDGET_RANGE[1]:
            raise StudyError(f"grid.budget[{i}]", f"{b} is out of range {BUDGET_RANGE[0]}..{BUDGET_RANGE[1]}", src)
    if "topk" in g:
        grid.topk = [None if k in (None, 0) else k for k in _as_list("grid.topk", g["topk"], int, src, allow_none=True)]
        for i, k in enumerate(grid.topk):
            if k is not None and k < 0:
                raise StudyError(f"grid.topk[{i}]", f"{k} must be >= 1 (0 or null: K = budget)", src)
    if "temperature" in g:
        grid.temperature = [float(t) for t in _as_list("grid.temperature", g["temperature"], float, src)]
        for i, t in enumerate(grid.temperature):
            if not 0.0 <= t <= 10.0:
                raise StudyError(f"grid.temperature[{i}]", f"{t} is out of range 0..10", src)
    grid.max_new_tokens = g.get("max_new_tokens", grid.max_new_tokens)
    if not 1 <= grid.max_new_tokens <= 65536:
        raise StudyError("grid.max_new_tokens", f"{grid.max_new_tokens} is out of range 1..65536", src)
    grid.seed = g.get("seed", grid.seed)

    n = _check_keys("notebooks", data.get("notebooks", {}), src)
    nbs = NotebooksSpec(**{**dataclasses.asdict(NotebooksSpec()), **n})
    for key in ("per_run", "per_study"):
        setattr(nbs, key, _as_list(f"notebooks.{key}", getattr(nbs, key), str, src) if getattr(nbs, key) else [])
    if not nbs.per_run:
        raise StudyError("notebooks.per_run", "needs at least one notebook (the first one generates)", src)
    if nbs.timeout < 1:
        raise StudyError("notebooks.timeout", f"{nbs.timeout} must be at least 1 second", src)
    report = data.get("report", True)
    to_check = [(f"notebooks.per_run[{i}]", x) for i, x in enumerate(nbs.per_run)]
    to_check += [(f"notebooks.per_study[{i}]", x) for i, x in enumerate(nbs.per_study)]
    if report:
        to_check.append(("notebooks.report", nbs.report))
    seen = set()
    for fname, nb in to_check:
        stem = Path(nb).stem
        if not re.match(r"^[A-Za-z0-9_.\-]+$", stem):
            raise StudyError(fname, f"{nb!r} has an unusable name", src)
        if fname.startswith("notebooks.per_study") and stem in seen:
            raise StudyError(fname, f"{nb!r} is listed twice", src)
        seen.add(stem)
        if find_notebook(nb, base) is None:
            dirs = ", ".join(str(d) for d in notebook_dirs(base))
            raise StudyError(fname, f"notebook {nb!r} not found (looked in {dirs})", src)

    # results from serving stacks (ddtree-lab ingest) that join this study's report
    external = _as_list("external", data["external"], str, src) if data.get("external") not in (None, []) else []
    for i, x in enumerate(external):
        resolved = _resolve_path(x, base)
        if check_files and not (resolved.exists() or resolved.is_symlink()):
            raise StudyError(f"external[{i}]", f"{x!r} does not exist", src)
        external[i] = str(resolved)

    return Study(name=name, models=models, prompts=prompts, methods=methods, grid=grid,
                 notebooks=nbs, report=report, description=data.get("description", ""),
                 warmup=data.get("warmup", True), external=external, path=path)


def load_study(path: str | os.PathLike, check_files: bool = True) -> Study:
    import yaml
    path = Path(path).resolve()
    if not path.is_file():
        raise StudyError("", "file not found", str(path))
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise StudyError("", f"not valid YAML{where}: {getattr(e, 'problem', e)}", str(path)) from None
    return parse_study(data, path, check_files=check_files)


# ----------------------------------------------------------------------------- grid
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
    prompt_set: str = "lab:code"
    n_prompts: int = 2
    method: str = "ddtree"
    budget: int = 32              # ddtree only; 0 for ar/dflash
    topk: int = 0                 # 0 -> K = budget
    temperature: float = 0.0
    max_new_tokens: int = 32
    seed: int = 0
    warmup: bool = True
    budgets: list = field(default_factory=list)  # the study's ddtree budgets (per-study notebooks)

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


def _fmt_t(t: float) -> str:
    return f"{t:g}"


def run_name(method: str, budget: int | None = None, topk: int | None = None, temperature: float = 0.0) -> str:
    if method == "ddtree":
        return f"ddtree-b{budget}-k{topk or 0}-t{_fmt_t(temperature)}"
    return f"{method}-t{_fmt_t(temperature)}"


def _base_params(study: Study, study_dir: Path) -> dict:
    m = study.models
    return dict(study_name=study.name, study_dir=str(study_dir), pair=m.pair or "",
                target_dir=m.target or "", drafter_dir=m.drafter or "", device=m.device,
                dtype=m.dtype, attention=m.attention, compile=m.compile, prompt_set=study.prompts.set,
                n_prompts=study.prompts.n_prompts, max_new_tokens=study.grid.max_new_tokens,
                seed=study.grid.seed, warmup=study.warmup, budgets=sorted(set(study.grid.budget)))


def expand_grid(study: Study, study_dir: Path | str = ".") -> list[RunParams]:
    """All runs in execution order: AR first (the reference), then DFlash, then DDTree by budget."""
    base = _base_params(study, Path(study_dir))
    runs: list[RunParams] = []
    seen: set = set()
    for meth in [m for m in METHODS if m in study.methods]:
        for t in study.grid.temperature:
            points = [(0, 0)]
            if meth == "ddtree":
                points = [(b, k or 0) for b in sorted(set(study.grid.budget)) for k in study.grid.topk]
            for b, k in points:
                k_eff = 0 if (k == 0 or k >= b) else k  # topk >= budget is the same tree as K = budget
                key = (meth, b, k_eff, t)
                if key in seen:
                    continue
                seen.add(key)
                runs.append(RunParams(**base, run_name=run_name(meth, b, k_eff, t), run_dir=".",
                                      method=meth, budget=b, topk=k_eff, temperature=t))
    return runs


def study_params(study: Study, study_dir: Path, notebook: str) -> RunParams:
    """Parameters for a once-per-study notebook: it profiles / summarises a middle budget."""
    base = _base_params(study, study_dir)
    budgets = base["budgets"]
    mid = budgets[len(budgets) // 2] if budgets else 32
    return RunParams(**base, run_name=Path(notebook).stem, run_dir=".", method="ddtree", budget=mid,
                     topk=0, temperature=study.grid.temperature[0])


# ----------------------------------------------------------------------------- execution
@dataclass
class RunOutcome:
    name: str
    status: str                   # complete | failed | skipped
    seconds: float = 0.0
    error: str | None = None


@dataclass
class StudySummary:
    study_dir: Path
    outcomes: list[RunOutcome]
    report: Path | None

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)


def read_run_status(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / "run.json").read_text())
    except (OSError, ValueError):
        return None


def _kernel_env() -> dict:
    # The kernel must import this very package even when it is not pip-installed.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    # One CPU thread unless the user says otherwise: the lab pair's matrices are too small to gain from
    # more, and OpenMP threads stall (10-1000x slower ops) whenever another process holds a core,
    # which would make CPU timings of a study meaningless. GPU runs do not depend on it.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _short_error(exc: BaseException) -> str:
    ename, evalue = getattr(exc, "ename", None), getattr(exc, "evalue", None)
    if ename:
        return f"{ename}: {evalue}"
    return f"{type(exc).__name__}: {exc}"


def execute_notebook(nb: Path, out_nb: Path, params: RunParams, cwd: Path, timeout: int,
                     progress: bool) -> None:
    import papermill as pm
    old = dict(os.environ)
    os.environ.update(_kernel_env())
    try:
        pm.execute_notebook(str(nb), str(out_nb), parameters=params.to_json(), kernel_name=KERNEL,
                            cwd=str(cwd), progress_bar=progress, execution_timeout=timeout,
                            store_widget_state=False)  # widget state would embed plotly.js per notebook
    finally:
        os.environ.clear()
        os.environ.update(old)


def execute_run(name: str, notebooks: list[Path], params: RunParams, study_dir: Path,
                timeout: int = 3600, progress: bool = True, log=print, kind: str = "run") -> RunOutcome:
    """Execute `notebooks` in order into `<study_dir>/<name>/` (atomically); never raises for a
    notebook error: the failure and the partial notebook are recorded in the run directory."""
    t0 = time.perf_counter()
    status, error, tb, error_nb = "complete", None, None, None
    with atomic_dir(study_dir / name) as tmp:
        for nb in notebooks:
            log(f"    {nb.name}")
            try:
                execute_notebook(nb, tmp / nb.name, params, tmp, timeout, progress)
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - any failure becomes a recorded failed run
                status, error = "failed", _short_error(e)
                tb = "".join(traceback.format_exception_only(type(e), e))[-4000:]
                error_nb = nb.name
                break
        secs = time.perf_counter() - t0
        atomic_write_json(tmp / "run.json", {
            "name": name, "kind": kind, "status": status, "fingerprint": params.fingerprint(),
            "params": params.to_json(), "notebooks": [n.name for n in notebooks],
            "error": error, "error_notebook": error_nb, "error_detail": tb,
            "seconds": round(secs, 3), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return RunOutcome(name, status, secs, error)


def _needs_run(run_dir: Path, fingerprint: str, retry_failed: bool) -> bool:
    st = read_run_status(run_dir)
    if st is None or st.get("fingerprint") != fingerprint:
        return True
    return st.get("status") != "complete" and retry_failed


def run_study(study: Study, study_dir: str | os.PathLike | None = None, *, retry_failed: bool = True,
              progress: bool = True, log=print) -> StudySummary:
    """Execute a validated study; see the module docstring."""
    study_dir = Path(study_dir or Path("outputs") / study.name).resolve()
    study_dir.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(study_dir)
    base = study.path.parent if study.path else None
    runs = expand_grid(study, study_dir)
    atomic_write_json(study_dir / "study.json", {"study": study.to_json(),
                                                 "runs": [r.run_name for r in runs]})
    if study.path:
        atomic_write_text(study_dir / "study.yaml", study.path.read_text(encoding="utf-8"))

    per_run = [find_notebook(n, base) for n in study.notebooks.per_run]
    outcomes: list[RunOutcome] = []
    total = len(runs) + len(study.notebooks.per_study)
    for i, params in enumerate(runs, 1):
        rdir = study_dir / params.run_name
        if not _needs_run(rdir, params.fingerprint(), retry_failed):
            log(f"[{i}/{total}] {params.run_name}: complete, skipped")
            outcomes.append(RunOutcome(params.run_name, "skipped"))
            continue
        log(f"[{i}/{total}] {params.run_name}")
        o = execute_run(params.run_name, per_run, params, study_dir, study.notebooks.timeout, progress, log)
        log(f"    {o.status} in {o.seconds:.1f}s" + (f": {o.error}" if o.error else ""))
        outcomes.append(o)

    # Once-per-study notebooks depend on every run's results: their fingerprint covers them.
    state = [(o.name, (read_run_status(study_dir / o.name) or {}).get("finished_at")) for o in outcomes]
    for j, nb_name in enumerate(study.notebooks.per_study, len(runs) + 1):
        params = study_params(study, study_dir, nb_name)
        fp_params = dataclasses.replace(params, run_name=f"{params.run_name}|{json.dumps(state)}")
        name = Path(nb_name).stem
        if not _needs_run(study_dir / name, fp_params.fingerprint(), retry_failed):
            log(f"[{j}/{total}] {name}: complete, skipped")
            outcomes.append(RunOutcome(name, "skipped"))
            continue
        log(f"[{j}/{total}] {name}")
        o = _execute_study_notebook(name, find_notebook(nb_name, base), params, fp_params, study_dir,
                                    study.notebooks.timeout, progress, log)
        log(f"    {o.status} in {o.seconds:.1f}s" + (f": {o.error}" if o.error else ""))
        outcomes.append(o)

    report = None
    if study.report:
        report = _make_report(study, study_dir, base, progress, log)
    return StudySummary(study_dir, outcomes, report)


def _execute_study_notebook(name, nb, params, fp_params, study_dir, timeout, progress, log):
    o = execute_run(name, [nb], params, study_dir, timeout, progress, log, kind="study")
    st = read_run_status(study_dir / name)
    if st is not None:  # store the fingerprint that includes the runs' state
        st["fingerprint"] = fp_params.fingerprint()
        atomic_write_json(study_dir / name / "run.json", st)
    return o


def _make_report(study: Study, study_dir: Path, base, progress: bool, log) -> Path:
    """Execute the findings notebook (it writes report.html); if that notebook fails, build the
    page in-process so a study always ends with a report."""
    from .report import build_report
    nb = find_notebook(study.notebooks.report, base)
    params = RunParams(**_base_params(study, study_dir), run_name="findings_report", run_dir=".")
    log(f"report: {nb.name}")
    o = execute_run(Path(study.notebooks.report).stem, [nb], params, study_dir,
                    study.notebooks.timeout, progress, log, kind="report")
    path = study_dir / REPORT_FILE
    if o.status != "complete" or not path.is_file():
        log(f"    report notebook {o.status}: {o.error}; building the report directly")
        build_report(study_dir)
    log(f"report: {path}")
    return path


def main_study(path: str | os.PathLike, out: str | os.PathLike | None = None, *,
               retry_failed: bool = True, progress: bool = True, log=print) -> StudySummary:
    """Validate the study file (raising StudyError before anything runs), then run it.

    `out` is the study's output directory (default: outputs/<name>)."""
    study = load_study(path)
    return run_study(study, out, retry_failed=retry_failed, progress=progress, log=log)


# ----------------------------------------------------------------------------- CLI pieces
def add_study_args(p) -> None:
    p.description = "Run a study: expand the grid, execute notebooks with papermill, write the report."
    p.add_argument("params", help="study file (YAML), e.g. params/quickstart.yaml")
    p.add_argument("--out", default=None, help="output directory for this study (default: outputs/<name>)")
    p.add_argument("--check", action="store_true", help="only validate the study file and list its runs")
    p.add_argument("--no-retry-failed", action="store_true", help="keep failed runs as they are on a re-run")
    p.add_argument("--quiet", action="store_true", help="no per-cell progress bars")


def run_study_cli(args) -> int:
    try:
        if args.check:
            study = load_study(args.params)
            out = Path(args.out or Path("outputs") / study.name)
            for r in expand_grid(study, out):
                print(r.run_name)
            print(f"ok: {len(expand_grid(study))} runs -> {out}")
            return 0
        s = main_study(args.params, args.out, retry_failed=not args.no_retry_failed,
                       progress=not args.quiet)
    except StudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{s.count('complete')} run(s) completed, {s.count('skipped')} skipped, "
          f"{s.count('failed')} failed -> {s.study_dir}")
    if s.report:
        print(f"report: {s.report}")
    return 1 if s.count("failed") else 0
