"""A study file (YAML) -> a validated `Study`, refused before anything runs.

A study file is refused if any key is unknown, repeated, mistyped or out of range, or if a notebook,
model directory or prompt set is missing; the message names the field (`grid.budget[2]: 2048 is out
of range 1..1024`). docs/workbench.md has the schema. This module imports no torch: the CLI stays
fast and validation is cheap.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import pairs
from ..environment import PACKAGE_DIR, REPO_DIR
from ..names import ATTENTION_BACKENDS, AUTO, AUTO_MAX_CANDIDATES, MAX_BUDGET, METHODS, STUDY_DTYPES, is_budget
from ..prompts import SHIPPED_SET, read_prompt_set, resolve_prompt_set
from ..runtime import RuntimeCheckError, check_runtime

DEVICES = re.compile(r"^(cpu|cuda|cuda:\d+|auto)$")
PAIR_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@~\-]*$")  # @ and ~: a random shape's depth and weight sets
STUDY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


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
    routing: str = ""             # an MoE target's: router | uniform | trace:FILE ("": uniform for random shapes,
                                  # the checkpoint's router otherwise); workbench/routing_dumps.py


@dataclass
class PromptsSpec:
    set: str = "lab:code"         # "lab:<name>" (shipped with the lab pair) or a .jsonl path
    n_prompts: int = 4            # first n prompts of the set


@dataclass
class GridSpec:
    budget: list[int | str] = field(default_factory=lambda: [16, 32, 64])  # and at most one "auto"
    topk: list[int | None] = field(default_factory=lambda: [None])  # None/0 -> K = budget
    temperature: list[float] = field(default_factory=lambda: [0.0])
    max_new_tokens: int = 64
    seed: int = 0
    repeats: int = 3              # timed passes over the prompt set per run: median and spread


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
               "compile": bool, "routing": str},
    "prompts": {"set": str, "n_prompts": int},
    "grid": {"budget": list, "topk": list, "temperature": list, "max_new_tokens": int, "seed": int,
             "repeats": int},
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


def _grid_budgets(value, src: str | None) -> list:
    """grid.budget: integers in 1..MAX_BUDGET, and `auto` at most once. The `auto` run chooses each round's
    budget on the device among the grid's integer budgets (`AutoBudget(budgets=tuple(sorted(ints)))`), or
    among AUTO_CANDIDATES when the grid has no integer budget."""
    items = value if isinstance(value, list) else [value]
    if not items:
        raise StudyError("grid.budget", "must not be empty", src)
    out: list = []
    for i, b in enumerate(items):
        where = f"grid.budget[{i}]"
        if isinstance(b, str) and b.strip().lower() == AUTO:
            if AUTO in out:
                raise StudyError(where, f"{AUTO!r} is listed twice (one auto run chooses among all the budgets)", src)
            out.append(AUTO)
        elif not _is(b, int):
            raise StudyError(where, f"must be an integer or {AUTO!r}, got {b!r}", src)
        elif not is_budget(b):
            raise StudyError(where, f"{b} is out of range 1..{MAX_BUDGET}", src)
        else:
            out.append(b)
    fixed = sorted({b for b in out if b != AUTO})
    if AUTO in out and len(fixed) > AUTO_MAX_CANDIDATES:
        raise StudyError(f"grid.budget[{out.index(AUTO)}]", f"{AUTO!r} chooses among at most {AUTO_MAX_CANDIDATES} "
                                                          f"budgets; the grid has {len(fixed)} integer budgets", src)
    return out


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


def _check_named_pair(name: str, src: str | None) -> None:
    try:
        pairs.check(name)
    except ValueError as e:  # CheckpointError: the pair would not load, so every run would fail
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
    elif check_files:
        _check_named_pair(models.pair, src)
    if not DEVICES.match(models.device):
        raise StudyError("models.device", f"{models.device!r} must be cpu, cuda, cuda:N or auto", src)
    if check_files and models.device.startswith("cuda"):
        import torch  # every run would fail: refuse now
        if not torch.cuda.is_available():
            raise StudyError("models.device", f"{models.device!r} requested but no CUDA device is visible", src)
        if ":" in models.device and int(models.device.split(":")[1]) >= torch.cuda.device_count():
            raise StudyError("models.device", f"{models.device!r}: only {torch.cuda.device_count()} CUDA device(s)", src)
    if models.dtype not in STUDY_DTYPES:
        raise StudyError("models.dtype", f"{models.dtype!r} must be one of {', '.join(STUDY_DTYPES)}", src)
    if models.attention not in ATTENTION_BACKENDS:
        raise StudyError("models.attention",
                         f"{models.attention!r} must be one of {', '.join(ATTENTION_BACKENDS)}", src)

    p = _check_keys("prompts", data["prompts"], src)
    prompts = PromptsSpec(**{**dataclasses.asdict(PromptsSpec()), **p})
    if prompts.n_prompts < 1:
        raise StudyError("prompts.n_prompts", f"{prompts.n_prompts} must be at least 1", src)
    if check_files:
        resolved = resolve_prompt_set(prompts.set, base)
        if resolved is None:
            known = ", ".join(pairs.available_prompt_sets()) or "none installed"
            raise StudyError("prompts.set", f"prompt set {prompts.set!r} not found (shipped sets: {known})", src)
        try:
            rows = read_prompt_set(prompts.set, None, base)
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
        grid.budget = _grid_budgets(g["budget"], src)
    elif "ddtree" in methods:
        raise StudyError("grid.budget", "is required when methods include ddtree", src)
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
    if not 0 <= grid.seed <= SEED_LIMIT - prompts.n_prompts:  # prompt i samples with seed + i
        raise StudyError("grid.seed", f"{grid.seed} is out of range 0..2^63-1-n_prompts "
                                      f"({SEED_LIMIT - prompts.n_prompts})", src)
    grid.repeats = g.get("repeats", grid.repeats)
    if not 1 <= grid.repeats <= 100:
        raise StudyError("grid.repeats", f"{grid.repeats} is out of range 1..100", src)

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
        found = find_notebook(nb, base)
        if found is None:
            dirs = ", ".join(str(d) for d in notebook_dirs(base))
            raise StudyError(fname, f"notebook {nb!r} not found (looked in {dirs})", src)
        if check_files:
            _check_is_notebook(found, fname, src)

    # results from serving stacks (ddtree-lab ingest) that join this study's report
    external = _as_list("external", data["external"], str, src) if data.get("external") not in (None, []) else []
    for i, x in enumerate(external):
        resolved = _resolve_path(x, base)
        if check_files and not (resolved.exists() or resolved.is_symlink()):
            raise StudyError(f"external[{i}]", f"{x!r} does not exist", src)
        external[i] = str(resolved)

    study = Study(name=name, models=models, prompts=prompts, methods=methods, grid=grid,
                  notebooks=nbs, report=report, description=data.get("description", ""),
                  warmup=data.get("warmup", True), external=external, path=path)
    if check_files:
        _check_runtime(study, src)
        _check_routing(study, base, src)
        _check_prompts_fit(study, base, src)
    return study


SEED_LIMIT = 2 ** 63 - 1  # torch generators take a signed 64-bit seed


def _check_is_notebook(path: Path, fname: str, src: str | None) -> None:
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise StudyError(fname, f"{path} is not a notebook (not JSON: {e})", src) from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise StudyError(fname, f"{path} is not a notebook (no 'cells' list)", src)


def _check_runtime(study: Study, src: str | None) -> None:
    """The machine must run the study's device and attention (runtime.check_runtime: the API's own check)."""
    m = study.models
    try:
        check_runtime(m.device, m.attention)
    except RuntimeCheckError as e:
        raise StudyError(f"models.{e.field}", str(e), src) from None
    if m.attention == "invariant" and _is_moe(study):
        raise StudyError("models.attention", "invariant covers dense targets; this target has MoE layers (the "
                                             "fused-MoE kernel tiles by the number of tokens)", src)


def _check_routing(study: Study, base: Path | None, src: str | None) -> None:
    """models.routing: a known model, for an MoE target; a trace's dump read now (its path made absolute, as the
    notebooks run elsewhere), so a dump that cannot drive the runs is refused before any runs."""
    m = study.models
    if not m.routing:
        return
    from .routing_replay import routing_model

    if not _is_moe(study):
        raise StudyError("models.routing", f"{m.routing!r} declares an MoE target's routing; this target is dense", src)
    if m.routing.startswith("trace:") and m.routing[len("trace:"):]:
        m.routing = "trace:" + str(_resolve_path(m.routing[len("trace:"):], base))
    try:
        routing_model(m.routing)
    except ValueError as e:
        raise StudyError("models.routing", str(e), src) from None


def _is_moe(study: Study) -> bool:
    """Whether the study's target has mixture-of-experts layers."""
    cfg = _target_config(study) or {}
    return bool(cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts"))


def _target_config(study: Study) -> dict | None:
    """The target's config: its random shape, or its config.json (None when unreadable: the loader names
    what is wrong with the file)."""
    m = study.models
    if m.pair and m.pair.startswith(pairs.RANDOM_PREFIX):
        from ..pairs.random import shape_entry  # a torch-free table of sizes

        return shape_entry(m.pair[len(pairs.RANDOM_PREFIX):])
    target = _target_dir(study)
    try:
        cfg = json.loads((target / "config.json").read_text(encoding="utf-8")) if target else None
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _target_dir(study: Study) -> Path | None:
    m = study.models
    if m.pair and not m.pair.startswith(pairs.RANDOM_PREFIX):
        return Path(pairs.resolve(m.pair)[0])
    return Path(m.target) if m.target else None


def _check_prompts_fit(study: Study, base: Path | None, src: str | None) -> None:
    """Every run would fail on a prompt that does not fit the context with max_new_tokens, or on chat
    prompts for a checkpoint without a chat template: refuse them now, naming the prompt."""
    m, g = study.models, study.grid
    target, cfg = _target_dir(study), _target_config(study)
    if cfg is None:
        return  # the loader names what is wrong with the file; nothing to compare against here
    try:
        limit = int(cfg.get("max_position_embeddings") or 0)
    except (TypeError, ValueError):
        return
    if target is None:  # random weights: prompts go in as their UTF-8 bytes
        count, template = (lambda text: len(text.encode("utf-8"))), True
    else:
        tok_file, tcfg_file = target / "tokenizer.json", target / "tokenizer_config.json"
        count = None
        if tok_file.is_file():
            try:
                from tokenizers import Tokenizer
                tok = Tokenizer.from_file(str(tok_file))
                count = lambda text: len(tok.encode(text, add_special_tokens=False).ids)  # noqa: E731
            except Exception:  # noqa: BLE001 - the loader reports a corrupt tokenizer with its path
                count = None
        try:
            tcfg = json.loads(tcfg_file.read_text(encoding="utf-8")) if tcfg_file.is_file() else {}
        except (OSError, ValueError):
            tcfg = {}
        template = bool((isinstance(tcfg, dict) and tcfg.get("chat_template"))
                        or (target / "chat_template.jinja").is_file())
    if limit and g.max_new_tokens >= limit:
        raise StudyError("grid.max_new_tokens", f"{g.max_new_tokens} leaves no room for a prompt in the "
                                                f"model's context of {limit} tokens", src)
    rows = read_prompt_set(study.prompts.set, study.prompts.n_prompts, base)
    for row in rows:
        chat = isinstance(row["prompt"], list)
        if chat and not template:
            raise StudyError("prompts.set", f"prompt {row['id']!r} is a chat prompt but {target} has no chat "
                                            "template (tokenizer_config.json 'chat_template')", src)
        if count is None or not limit:
            continue
        text = "".join(str(x.get("content", "")) for x in row["prompt"]) if chat else row["prompt"]
        n = count(text)  # a chat template only adds tokens: this is a lower bound
        if n + g.max_new_tokens > limit:
            raise StudyError("grid.max_new_tokens", f"prompt {row['id']!r} ({n} tokens) + {g.max_new_tokens} new "
                                                    f"tokens exceeds the model's context of {limit}", src)


def _yaml_loader():
    """PyYAML's safe loader, refusing a mapping that repeats a key (plain YAML keeps the last silently)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def load_study(path: str | os.PathLike, check_files: bool = True) -> Study:
    import yaml
    path = Path(path).resolve()
    if not path.is_file():
        raise StudyError("", "file not found", str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise StudyError("", f"unreadable: {e}", str(path)) from None
    try:
        data = yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise StudyError("", f"not valid YAML{where}: {getattr(e, 'problem', e)}", str(path)) from None
    return parse_study(data, path, check_files=check_files)


