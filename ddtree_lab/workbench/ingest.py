"""Results from serving stacks: recognise benchmark files by content, give each run its settings
(with where each value came from) and a verdict with its reason.

    ddtree-lab ingest PATH... --out DIR      -> DIR/external.json, DIR/routing.json, DIR/report.html

Formats (see docs/workbench.md, "Results from serving stacks"; recognised in `formats`): the
serving benchmark's `--output-file` JSON lines (three field sets), the one-batch server benchmark's
JSON lines, and the `bench serve --save-result` JSON document; routing dumps go to `routing_dumps` and
`routing_formats` (routing.json). Files are streamed (`jsonstream`), so
their size does not matter. A file or folder whose name is not UTF-8 is not read: one message names it
(escaped), as external.json and the page could not hold the name itself. This module imports neither
torch nor the engine.
"""
from __future__ import annotations

import argparse
import codecs
import errno
import json
import os
import string
import sys
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..atomic import atomic_write_json
from .formats import (ONE_BATCH, RESULT_FIELDS, SERVING, SETTINGS, VLLM_SERVE, _KNOWN_FIELDS, _int, _num,
                      absent_means_ar, field_settings, name_settings, recognise, recognise_partial, server_args)
from .jsonstream import compress_ratio, read_values
from .routing import DEFAULT_EP_RANKS
from .routing_dumps import ROUTING_FILE, problem_lines, read_routing_file, routing_document
from .routing_formats import SNIFF_BYTES, RoutingOptions, RoutingRefusal, has_marker, is_candidate

SCHEMA = 1
EXTERNAL_FILE, REPORT_FILE = "external.json", "report.html"

# ----------------------------------------------------------------------------- thresholds
TINY_FILE_BYTES = 512          # a real run record is over a kilobyte; below this with no record: failed
REPEAT_COMPRESS_RATIO = 0.1    # a generated text that zlib shrinks below this share is a long repeat
REPEAT_MIN_CHARS = 200         # ... judged only from this length on (short texts compress badly)
PUNCT_SHARE = 0.6              # share of non-space characters that are punctuation or symbols
ONE_CHAR_SHARE = 0.6           # share of non-space characters taken by the commonest one
MIN_JUDGED_CHARS = 20          # punctuation / one-character tests from this many non-space chars
GARBAGE_TEXT_SHARE = 0.5       # a run is garbage when this share of its texts is degenerate
RETOKENIZED_RATIO = (0.5, 1.5)  # retokenized / reported output tokens outside this range: garbage
THRESHOLDS = {name: globals()[name] for name in (
    "TINY_FILE_BYTES", "REPEAT_COMPRESS_RATIO", "REPEAT_MIN_CHARS", "PUNCT_SHARE", "ONE_CHAR_SHARE",
    "MIN_JUDGED_CHARS", "GARBAGE_TEXT_SHARE", "RETOKENIZED_RATIO")}

VERDICTS = ("ok", "suspect", "partial", "garbage", "truncated", "failed")
RUN_KEYS = ("file", "line", "engine", "tool", "verdict", "reason", "model", "method", "budget", "topk",
            "draft_window", "concurrency", "tp", "completed", "failed", "output_throughput", "mean_tpot_ms",
            "accept_length", "speedup_over_ar", "sources")
_PUNCT = set(string.punctuation) | set("…–—‘’“”«»·•¡¿")
# A head with a larger share of bytes that are not UTF-8 is no text: random bytes come out about 40 %
# undecodable, a Latin-1 text a few % (its odd characters are read as U+FFFD).
BINARY_UNDECODABLE_SHARE = 0.25


def degenerate_reason(text: str) -> str | None:
    """Why one generated text looks degenerate, or None."""
    if not text.strip():
        return "empty text"
    if len(text) >= REPEAT_MIN_CHARS and compress_ratio(text) < REPEAT_COMPRESS_RATIO:
        return "long repeats"
    counts = Counter(text)
    for c in [c for c in counts if c.isspace()]:
        del counts[c]
    n = sum(counts.values())
    if n >= MIN_JUDGED_CHARS:
        if sum(k for c, k in counts.items() if c in _PUNCT) / n > PUNCT_SHARE:
            return "mostly punctuation"
        if max(counts.values()) / n > ONE_CHAR_SHARE:
            return "one character"
    return None


# ----------------------------------------------------------------------------- runs
@dataclass
class Run:
    file: str
    line: int
    engine: str | None = None
    tool: str | None = None
    verdict: str = "ok"
    reason: str = ""
    values: dict = field(default_factory=dict)   # the contract's settings and measurements
    sources: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)    # what the report and the checks also use
    server: str | None = None                    # the server this run measured, when known

    def to_json(self) -> dict:
        d = {"file": self.file, "line": self.line, "engine": self.engine, "tool": self.tool,
             "verdict": self.verdict, "reason": self.reason}
        for k in RUN_KEYS:
            if k not in d and k != "sources":
                d[k] = self.values.get(k)
        d["sources"] = dict(self.sources)
        return d


def _server_key(info: dict) -> str | None:
    if not info:
        return None
    volatile = {"internal_states", "status", "version", "last_gen_throughput"}
    return repr(sorted((k, repr(v)) for k, v in info.items() if k not in volatile))


def make_run(path: str, parsed, fmt: tuple, names: dict) -> Run:
    engine, tool, variant = fmt
    rec = parsed.value if isinstance(parsed.value, dict) else {}
    run = Run(path, parsed.line, engine, tool)
    vals, src = field_settings(rec, tool)
    for key in SETTINGS + ("hardware", "nvls"):
        if vals.get(key) is None and names.get(key) is not None:
            vals[key], src[key] = names[key], "filename"
    if vals.get("method") is None and absent_means_ar(rec, tool):
        vals["method"], src["method"] = "ar", "fields"
    run.sources = {k: v for k, v in src.items() if k in SETTINGS and vals.get(k) is not None}
    run.values = {k: vals.get(k) for k in SETTINGS}
    run.extra = {"variant": variant, "hardware": vals.get("hardware"), "nvls": bool(vals.get("nvls") or vals.get("_nvls")),
                 "dp": vals.get("_dp"), "cuda_graph": vals.get("_cuda_graph"), "steps": vals.get("_steps"),
                 "details": parsed.details, "bytes": parsed.size}
    run.server = _server_key(server_args(rec))
    d = parsed.details
    if tool == ONE_BATCH:
        completed, sent = _int(rec.get("batch_size")), _int(rec.get("batch_size"))
        thr = _num(rec.get("output_throughput"))
        tpot = 1e3 * completed / thr if completed and thr else None  # every request decodes each step
        acc = _num(rec.get("acc_length"))
    else:
        completed = _int(rec.get("completed"))
        thr, tpot = _num(rec.get("output_throughput")), _num(rec.get("mean_tpot_ms"))
        acc = _num(rec.get("spec_decode_acceptance_length") if tool == VLLM_SERVE else rec.get("accept_length"))
        sent = _int(rec.get("num_prompts"))
        if sent is None and not parsed.error:  # a cut record's arrays may be cut too
            sent = next((d.n(k) for k in ("errors", "input_lens", "output_lens", "ttfts") if d.n(k)), None)
    failed = _int(rec.get("failed"))
    if failed is None and sent is not None and completed is not None:
        failed = max(0, sent - completed)
    acc = acc if acc is not None and acc > 0 else None
    if run.values.get("method") == "ar":
        acc = None
    run.values.update(completed=completed, failed=failed, output_throughput=thr, mean_tpot_ms=tpot,
                      accept_length=acc, speedup_over_ar=None)
    run.extra["sent"] = sent
    run.extra["error"] = rec.get("error") if isinstance(rec.get("error"), str) and rec["error"].strip() else None
    out = _int(rec.get("total_output_tokens", rec.get("total_output")))
    retok = _int(rec.get("total_output_tokens_retokenized", rec.get("total_output_retokenized")))
    run.extra["retokenized_ratio"] = retok / out if out and retok is not None else None
    judge(run, parsed)
    return run


def judge(run: Run, parsed) -> None:
    """The run's verdict and reason from what it recorded (suspicions across runs come later)."""
    v, d = run.values, parsed.details
    completed, sent, failed = v["completed"], run.extra["sent"], v["failed"]
    if parsed.error:
        run.verdict, run.reason = "truncated", (f"the file ends inside this record ({parsed.size} bytes "
                                                f"read: {parsed.error})")
        return
    errs = f"; first error: {d.error_samples[0][:160]!r}" if d.error_samples else ""
    if run.extra.get("error"):  # the run's own error (a run that failed before measuring)
        errs = f"; error: {run.extra['error'][:160]!r}" + errs
    if completed == 0:
        run.verdict, run.reason = "failed", f"completed == 0{errs}"
        return
    if d.n("errors") and d.errors == d.n("errors"):
        run.verdict, run.reason = "failed", f"every request is an error ({d.errors}){errs}"
        return
    if sent is not None and completed is not None and completed < sent or (failed or 0) > 0 or d.errors:
        run.verdict = "partial"
        run.reason = (f"{completed} of {sent} requests completed" if sent is not None else
                      f"{failed} requests failed") + (f", {d.errors} errors" if d.errors else "") + errs
        return
    ratio = run.extra["retokenized_ratio"]
    if ratio is not None and not RETOKENIZED_RATIO[0] <= ratio <= RETOKENIZED_RATIO[1]:
        run.verdict = "garbage"
        run.reason = (f"retokenized / reported output tokens = {ratio:.3f}, outside "
                      f"{RETOKENIZED_RATIO[0]}..{RETOKENIZED_RATIO[1]}")
        return
    bad = sum(d.degenerate.values())
    if d.texts and bad / d.texts >= GARBAGE_TEXT_SHARE:
        why = ", ".join(f"{n} {k}" for k, n in sorted(d.degenerate.items(), key=lambda kv: -kv[1]))
        run.verdict = "garbage"
        run.reason = f"{bad} of {d.texts} generated texts are degenerate ({why})"
        return
    run.verdict, run.reason = "ok", ""


def flag_shared_servers(runs: list[Run]) -> None:
    """The serving benchmark's accept length is the server's running average since it started, on
    data-parallel rank 0 only: suspect when several runs in a file met one server, or dp > 1."""
    by_file: dict[str, list[Run]] = {}
    for r in runs:
        by_file.setdefault(r.file, []).append(r)
    for rs in by_file.values():
        seen: dict = {}
        for r in sorted(rs, key=lambda r: r.line):
            if r.tool not in (SERVING, ONE_BATCH) or r.values.get("accept_length") is None:
                continue
            why = []
            key = r.server if r.server is not None else ("no server_info", r.tool)
            if key in seen:
                first = seen[key]
                what = "the same server_info" if r.server is not None else "no server_info to tell servers apart"
                why.append(f"accept_length is the server's average since it started: run {first.line} in "
                           f"this file ran before on {what}, so this value mixes both runs")
            else:
                seen[key] = r
            if (r.extra.get("dp") or 1) > 1:
                why.append(f"dp = {r.extra['dp']}: accept_length comes from data-parallel rank 0 only")
            if why and r.verdict == "ok":
                r.verdict, r.reason = "suspect", "; ".join(why)
            elif why:
                r.reason += "; also suspect: " + "; ".join(why)


def add_speedups(runs: list[Run]) -> None:
    """Output throughput over the AR run of the same engine, model, hardware, tp and concurrency
    (the fastest such AR run when there are several)."""
    def key(r):
        return (r.engine, r.values.get("model"), r.extra.get("hardware"), r.extra.get("nvls"),
                r.values.get("tp"), r.values.get("concurrency"))
    usable = [r for r in runs if r.verdict in ("ok", "suspect") and r.values.get("output_throughput")]
    base: dict = {}
    for r in usable:
        if r.values.get("method") == "ar":
            k = key(r)
            base[k] = max(base.get(k, 0.0), r.values["output_throughput"])
    for r in usable:
        if key(r) in base:
            r.values["speedup_over_ar"] = r.values["output_throughput"] / base[key(r)]


# ----------------------------------------------------------------------------- files
def _open(path: str):
    return open(path, "rb")


def ingest_file(path: Path, root: Path | None) -> tuple[list[Run], list[dict]]:
    """One file -> its runs and its messages (unrecognised lines, or the file itself)."""
    name = str(path)
    try:
        size = path.stat().st_size
        with _open(name) as f:
            head = f.read(8192)
            binary = _is_binary(head)
    except OSError as e:
        return [], [{"file": name, "reason": f"unreadable: {e.strerror or e}"}]
    names = name_settings(path, root)
    if not head.strip():
        run = _bare_run(name, 1, names)
        run.verdict, run.reason = "failed", "empty file"
        return [run], []
    if binary:
        return [], [{"file": name, "reason": "binary file, not a benchmark result"}]
    try:
        with _open(name) as f:
            parsed = list(read_values(f, head, degenerate_reason))
    except OSError as e:
        return [], [{"file": name, "reason": f"unreadable: {e.strerror or e}"}]
    runs, notes, tool = [], [], None
    for p in parsed:
        fmt = recognise(p.value)
        if fmt is None and p.error and isinstance(p.value, dict) and _KNOWN_FIELDS & p.value.keys():
            fmt = tool or recognise_partial(p.value)
        # a run that died before writing its record leaves a few bytes of it; a cut record that got to
        # its results (completed, throughput) is a record cut short, whatever the file's size
        tiny = p.error and not runs and size < TINY_FILE_BYTES and not (
            isinstance(p.value, dict) and RESULT_FIELDS & p.value.keys())
        if fmt is not None or tiny:
            run = make_run(name, p, fmt, names) if fmt else _bare_run(name, p.line, names)
            tool = fmt or tool
            if tiny:  # a run that died before writing its record, not a record cut short
                run.verdict, run.reason = "failed", f"tiny file ({size} bytes) holding no complete record"
            elif run.verdict == "truncated" and p is not parsed[-1]:  # more of the file follows
                run.reason = (f"cut off mid-file: the record stops after {p.size} bytes and the file goes on "
                              f"({p.error})")
            runs.append(run)
        elif p.error:
            notes.append({"file": name, "reason": f"line {p.line}: not JSON ({p.error})"})
        elif p.overflow:
            notes.append({"file": name, "reason": f"line {p.line}: a large JSON value of no known format"})
        else:
            keys = ", ".join(map(str, list(p.value)[:6])) if isinstance(p.value, dict) else type(p.value).__name__
            notes.append({"file": name, "reason": f"line {p.line}: JSON of no known format ({keys})"})
    if not runs and len(notes) > 1:  # one message for a file that is not a result file at all
        notes = [{"file": name, "reason": f"{notes[0]['reason']} (and {len(notes) - 1} more such lines)"}]
    return runs, notes


def _bare_run(name: str, line: int, names: dict) -> Run:
    """A run known only from its file name (an empty or tiny file)."""
    run = Run(name, line)
    run.values = {k: names.get(k) for k in SETTINGS}
    run.values.update(dict.fromkeys(("completed", "failed", "output_throughput", "mean_tpot_ms",
                                     "accept_length", "speedup_over_ar")))
    run.sources = {k: "filename" for k in SETTINGS if names.get(k) is not None}
    run.extra = {"hardware": names.get("hardware"), "nvls": bool(names.get("nvls"))}
    return run


def _is_binary(head: bytes) -> bool:
    """NUL bytes, or mostly bytes that are not UTF-8; a few stray ones are text (jsonstream repairs them)."""
    if b"\0" in head:
        return True
    text = codecs.getincrementaldecoder("utf-8")("replace").decode(head)  # a character cut at the end waits
    undecodable = text.count("\ufffd") - head.count("\ufffd".encode())
    return undecodable > BINARY_UNDECODABLE_SHARE * len(head)


def shown(path) -> str:
    """A path as text every sink takes (JSON, HTML, a terminal): the bytes of a name that are not UTF-8
    as \\xNN (Python holds them as lone surrogates, which no UTF-8 writer accepts)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _is_text(path) -> bool:
    try:
        str(path).encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


# A path that is not UTF-8 cannot be written into external.json or the page as itself: not ingested.
NOT_UTF8 = "name is not valid UTF-8: not ingested (rename it)"
NOT_UTF8_FOLDER = "folder name is not valid UTF-8: nothing under it ingested (rename it)"


def walk(paths: list, skip: Path | None = None) -> tuple[list[tuple[Path, Path]], list[dict]]:
    """Files under the given paths (recursively, following links once) -> ([(file, root)], messages)."""
    files, notes, seen = [], [], set()
    for p in map(Path, paths):
        if (p.exists() or p.is_symlink()) and not _is_text(p):
            notes.append({"file": shown(p), "reason": NOT_UTF8_FOLDER if p.is_dir() else NOT_UTF8})
        elif p.is_symlink() and not p.exists():
            notes.append({"file": str(p), "reason": _link_problem(p)})
        elif p.is_file():
            files.append((p, p.parent))
        elif p.is_dir():
            n0 = len(files)
            def unreadable(e: OSError) -> None:
                notes.append({"file": str(e.filename), "reason": f"unreadable folder: {e.strerror or e}"})
            for dirpath, dirnames, filenames in os.walk(p, onerror=unreadable, followlinks=True):
                d = Path(dirpath)
                st = d.stat()
                if (st.st_dev, st.st_ino) in seen:
                    notes.append({"file": str(d), "reason": "symlink loop: this folder was already read"})
                    dirnames[:] = []
                    continue
                seen.add((st.st_dev, st.st_ino))
                if skip is not None and d.resolve() == skip:
                    dirnames[:] = []
                    continue
                dirnames[:] = sorted(x for x in dirnames if not x.startswith("."))
                notes += [{"file": shown(d / x), "reason": NOT_UTF8_FOLDER} for x in dirnames if not _is_text(x)]
                dirnames[:] = [x for x in dirnames if _is_text(x)]
                for fn in sorted(filenames):
                    fp = d / fn
                    if fn.startswith("."):
                        continue
                    if not _is_text(fn):
                        notes.append({"file": shown(fp), "reason": NOT_UTF8})
                    elif fp.is_symlink() and not fp.exists():
                        notes.append({"file": str(fp), "reason": _link_problem(fp)})
                    elif not fp.is_file():
                        notes.append({"file": str(fp), "reason": "not a regular file"})
                    else:
                        files.append((fp, p))
                if not dirnames and not filenames and d != p:
                    notes.append({"file": str(d), "reason": "empty folder"})
            if len(files) == n0 and not any(n["file"].startswith(str(p)) for n in notes):
                notes.append({"file": str(p), "reason": "empty folder: no files to ingest"})
        elif p.exists():
            notes.append({"file": str(p), "reason": "not a regular file or folder"})
        else:
            raise FileNotFoundError(f"no such file or folder: {shown(p)}")
    return files, notes


def _link_problem(p: Path) -> str:
    try:
        p.stat()
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "symlink loop"
        return f"broken symlink ({e.strerror})"
    return "broken symlink"


def ingest(paths: list, skip: str | os.PathLike | None = None) -> dict:
    """Paths (files or folders) -> the external.json document."""
    return ingest_all(paths, skip)[0]


def ingest_all(paths: list, skip: str | os.PathLike | None = None,
               options: RoutingOptions = RoutingOptions()) -> tuple[dict, dict]:
    """Paths (files or folders) -> (the external.json document, the routing.json document): each file is a
    routing dump (routing_dumps, recognised by content) or read as serving-benchmark results."""
    files, notes = walk(paths, Path(skip).resolve() if skip else None)
    runs, entries, unread = [], [], []
    for f, root in files:
        got = routing_file(f, options)
        if got is None:
            rs, ns = ingest_file(f, root)
            if not rs and ns and any("no known format" in n["reason"] for n in ns) and _has_marker(f):
                got = routing_file(f, options, kind="json")  # its routing field came after the first MiB
            if got is None:
                runs += rs
                notes += ns
                continue
        (entries if "reason" not in got else unread).append(got)
    flag_shared_servers(runs)
    add_speedups(runs)
    return ({"schema": SCHEMA, "runs": [r.to_json() for r in runs], "unrecognised": notes},
            routing_document(entries, unread, options))


def routing_file(path: Path, options: RoutingOptions, kind: str | None = None) -> dict | None:
    """A routing dump -> its routing.json entry, or {"file", "reason"} when it cannot be read; None for a file
    that is no routing dump."""
    try:
        with _open(str(path)) as f:
            head = f.read(SNIFF_BYTES)
        kind = kind or is_candidate(head)
        if kind == "pt" and not _torch_archive(path):
            return None
        if kind is None:
            return None
        entry = read_routing_file(path, kind, options)
    except RoutingRefusal as e:
        return {"file": shown(path), "reason": str(e)}
    except OSError as e:
        return None if kind is None else {"file": shown(path), "reason": f"unreadable: {e.strerror or e}"}
    if entry is not None:
        entry["file"] = shown(path)
    return entry


def _torch_archive(path: Path) -> bool:
    """A zip archive as torch.save writes it (a data.pkl inside)."""
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("data.pkl") for n in z.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def _has_marker(path: Path) -> bool:
    try:
        return has_marker(path)
    except OSError:
        return False


def study_external(study_dir: Path, study: dict) -> dict | None:
    """What a study's report shows from serving stacks (study_sources' first part)."""
    return study_sources(study_dir, study)[0]


def study_sources(study_dir: Path, study: dict) -> tuple[dict | None, dict | None]:
    """What a study's report shows from serving stacks and routing dumps: the study file's `external:` paths,
    ingested now, else an `external.json` in the study directory; the routing dumps among those paths, else a
    `routing.json` in the study directory; None for what is absent."""
    paths = (study.get("study") or {}).get("external") or []
    ext = routing = None
    if paths:
        existing = [p for p in paths if Path(p).exists() or Path(p).is_symlink()]
        ext, routing = ingest_all(existing)
        ext["unrecognised"] += [{"file": str(p), "reason": "listed under external: but missing"}
                                for p in paths if p not in existing]
        routing = routing if routing["files"] or routing["unread"] else None
    else:
        ext = _read_doc(Path(study_dir) / EXTERNAL_FILE, "runs",
                        lambda why: {"schema": SCHEMA, "runs": [], "unrecognised": [why]})
    if routing is None:
        routing = _read_doc(Path(study_dir) / ROUTING_FILE, "files",
                            lambda why: routing_document([], [why], RoutingOptions()))
    return ext, routing


def _read_doc(f: Path, key: str, broken) -> dict | None:
    if not f.is_file():
        return None
    try:
        doc = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        return broken({"file": shown(f), "reason": f"unreadable: {e}"})
    return doc if isinstance(doc, dict) and isinstance(doc.get(key), list) else None


# ----------------------------------------------------------------------------- CLI pieces
def add_ingest_args(p) -> None:
    p.description = ("Read serving-benchmark result files and routing dumps (each recognised by content), give "
                     "each run its settings and a verdict, and write OUT/external.json, OUT/routing.json and "
                     "OUT/report.html.")
    p.add_argument("paths", nargs="+", help="result files, routing dumps or folders (read recursively)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--experts", type=_positive("--experts"), default=None,
                   help="routing dumps: experts per MoE layer, where the dump does not say (default: the largest "
                        "id + 1, marked inferred)")
    p.add_argument("--top-k", type=_positive("--top-k"), default=None,
                   help="routing dumps: experts per token, where the dump does not say (SGLang's flat ids, the "
                        "recorder's per-pass counts)")
    p.add_argument("--ep-ranks", type=_positive("--ep-ranks"), default=DEFAULT_EP_RANKS,
                   help="routing dumps: ranks of the EP placement (contiguous blocks of experts)")


def _positive(flag: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = 0
        if v < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be a positive integer, got {text!r}")
        return v
    return parse


def run_ingest_cli(args) -> int:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"ddtree-lab ingest: error: --out {shown(out)} is a file, not a folder", file=sys.stderr)
        return 2
    options = RoutingOptions(getattr(args, "experts", None), getattr(args, "top_k", None),
                             getattr(args, "ep_ranks", DEFAULT_EP_RANKS))
    if options.experts is not None and options.experts < options.ep_ranks:
        print(f"ddtree-lab ingest: error: --ep-ranks {options.ep_ranks} needs at least as many experts "
              f"(--experts {options.experts})", file=sys.stderr)
        return 2
    try:
        doc, routing = ingest_all(args.paths, skip=out if out.exists() else None, options=options)
    except FileNotFoundError as e:
        print(f"ddtree-lab ingest: error: {e}", file=sys.stderr)
        return 2
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"ddtree-lab ingest: error: cannot create --out {shown(out)}: {e.strerror or e}", file=sys.stderr)
        return 2
    from . import ingest_report  # plotly only when a page is written
    try:
        atomic_write_json(out / EXTERNAL_FILE, doc)
        atomic_write_json(out / ROUTING_FILE, routing)
        page = ingest_report.write_page(doc, out / REPORT_FILE, THRESHOLDS, routing=routing)
    except OSError as e:
        print(f"ddtree-lab ingest: error: cannot write into {shown(out)}: {e.strerror or e}", file=sys.stderr)
        return 2
    counts = {v: sum(r["verdict"] == v for r in doc["runs"]) for v in VERDICTS}
    print(f"{len(doc['runs'])} run(s): " + ", ".join(f"{n} {v}" for v, n in counts.items() if n)
          + f"; {len(doc['unrecognised'])} message(s)")
    for n in doc["unrecognised"]:
        print(f"  {n['file']}: {n['reason']}", file=sys.stderr)
    lines = problem_lines(routing)
    print(f"{len(routing['files'])} routing dump(s); {len(lines)} message(s)")
    for line in lines:
        print(f"  {line}", file=sys.stderr)
    print(f"external: {shown(out / EXTERNAL_FILE)}\nrouting: {shown(out / ROUTING_FILE)}\nreport: {shown(page)}")
    return 0
