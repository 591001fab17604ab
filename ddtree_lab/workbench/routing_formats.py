"""The formats of routing dumps: recognise each by content and read it, in bounded memory, into the items
`routing_dumps` turns into routing.json (docs/workbench.md, "Routing dumps and routing.json").

What is read, per top-level JSON value of a file (one document, JSON lines, or a JSON array of them):
- vLLM (`--enable-return-routed-experts`): each choice's `routed_experts` (or each `outputs[i]`'s of a
  RequestOutput written as JSON), [tokens, layers, k], as base64 of a .npy file (the server's encoding) or
  nested lists;
- SGLang (`return_routed_experts`): `meta_info.routed_experts` (or `sglext.routed_experts`), base64 of the
  int32 ids, flat: [prompt + completion tokens − 1, layers, k], shaped with `meta_info`'s token counts and
  k (`--top-k`, else the largest k that makes every token's picks in a layer distinct, flagged inferred);
- SGLang's expert-distribution recorder (.pt written with torch.save; needs torch): `per_token` records
  (per forward pass, the ids of every token; the prefill chunks of one request are sequences too),
  `per_pass` and `stat` records (per forward pass, the tokens each expert got: no sequences, and the tokens
  of a pass need `--top-k`);
- our traces.jsonl rows (`experts_touched` per MoE layer per round): the union of each round's verify
  tokens, recorded as forwards at the round's tokens, no windows.
A layer every token of a file routes to expert 0 only is a dense layer's placeholder (the engines capture
every hidden layer) and is left out. This module imports torch only to read a .pt file.
"""
from __future__ import annotations

import base64
import binascii
import io
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .advisor.trace_stats import verify_tokens
from .jsonstream import is_json_lines, read_document, read_lines
from .routing import DEFAULT_EP_RANKS

VLLM, SGLANG, SGLANG_RECORDER, TRACES = ("vllm routed_experts", "sglang routed_experts",
                                         "sglang expert distribution", "ddtree-lab traces")
MARKERS = (b'"routed_experts"', b'"experts_touched"')
SNIFF_BYTES = 1 << 20   # a routing field in this much of a file's start makes it a routing dump candidate
NPY_MAGIC = b"\x93NUMPY"


@dataclass(frozen=True)
class RoutingOptions:
    """What the user may state that a dump does not: experts per layer, top_k, the EP placement's ranks."""
    experts: int | None = None
    top_k: int | None = None
    ep_ranks: int = DEFAULT_EP_RANKS


# ----------------------------------------------------------------------------- what a dump holds
@dataclass
class Sequence:
    """One sequence's routed expert ids, its tokens in order (None with `problem` when refused)."""
    where: str
    format: str
    ids: np.ndarray | None            # [tokens, layers, k]
    problem: str | None = None
    model: str | None = None
    k_inferred: bool = False


@dataclass
class Forward:
    """One forward pass: its tokens together, as ids, per-expert counts or per-layer distinct counts."""
    where: str
    format: str
    tokens: int | None
    ids: np.ndarray | None = None     # [tokens, layers, k]
    counts: np.ndarray | None = None  # [layers, E] tokens per expert
    touched: list | None = None       # [layers] distinct experts (our traces)
    problem: str | None = None
    experts: int | None = None        # experts per layer, where the dump says


# ----------------------------------------------------------------------------- JSON values
class _Routed:
    """Where a `routed_experts` value sits in a built response: its ids, or why not."""

    def __init__(self):
        self.payload: str | None = None   # base64
        self.ids: np.ndarray | None = None
        self.problem: str | None = None
        self.complete = False


class _NestedIds:
    """Parse events of a nested-list `routed_experts` -> [tokens, layers, k] ids, in bounded memory
    (int32 values, counts per token and per token-layer)."""

    def __init__(self, into: _Routed):
        self.into, self.depth = into, 0
        self.values, self.layers, self.ks = array("i"), array("i"), array("i")
        self.bad: str | None = None
        self._layers = self._k = 0

    def event(self, ev: str, value) -> bool:
        """-> True when the value has ended."""
        if ev == "start_array":
            self.depth += 1
            if self.depth == 2:
                self._layers = 0
            elif self.depth == 3:
                self._k = 0
            elif self.depth > 3 and not self.bad:
                self.bad = f"routed experts nest {self.depth} lists deep, not [tokens, layers, k]"
        elif ev == "end_array":
            if self.depth == 3:
                self.ks.append(self._k)
                self._layers += 1
            elif self.depth == 2:
                self.layers.append(self._layers)
            self.depth -= 1
        elif ev == "number" and self.depth == 3:
            if isinstance(value, int) and -2 ** 31 <= value < 2 ** 31:
                self.values.append(value)
                self._k += 1
            elif not self.bad:
                self.bad = f"routed experts hold {value!r}, not an expert id"
        elif not self.bad:
            what = "an expert id" if ev == "number" else f"a {ev.replace('start_', '')}"
            self.bad = (f"routed experts hold {what} {self.depth} list(s) deep, not [tokens, layers, k] "
                        f"(wrong rank)" if ev == "number" else f"routed experts hold {what}, not expert ids")
        if self.depth == 0:
            self._finish()
            return True
        return False

    def _finish(self) -> None:
        r = self.into
        r.complete = True
        if self.bad:
            r.problem = self.bad
            return
        layers, ks = np.frombuffer(self.layers, dtype=np.int32), np.frombuffer(self.ks, dtype=np.int32)
        if len(layers) and (layers != layers[0]).any():
            t = int(np.argmax(layers != layers[0]))
            r.problem = f"inconsistent layer counts across tokens: token {t} has {layers[t]}, token 0 {layers[0]}"
        elif len(ks) and (ks != ks[0]).any():
            i = int(np.argmax(ks != ks[0]))
            r.problem = (f"inconsistent k across tokens: token {i // layers[0]}, layer {i % layers[0]} routes to "
                         f"{ks[i]} experts, the first to {ks[0]}")
        else:
            n = len(layers)
            r.ids = np.frombuffer(self.values, dtype=np.int32).reshape(n, int(layers[0]) if n else 0,
                                                                       int(ks[0]) if n else 0)


class _Frame:
    """One open container of a response: its place (key or index), and what of it is kept: scalars and the
    few children the reader needs (meta_info, usage, tree; list lengths; experts_touched's counts)."""
    __slots__ = ("is_map", "place", "values", "count", "cur", "keep")

    def __init__(self, is_map: bool, place, keep: bool = False):
        self.is_map, self.place, self.keep = is_map, place, keep
        self.values: dict | list = {} if is_map else []
        self.count, self.cur = 0, None


_LINKED = frozenset({"meta_info", "usage", "tree"})   # child maps whose scalars a response's reading needs
_KEPT_LISTS = frozenset({"experts_touched"})           # child lists whose items are kept (small)
_MAX_KEYS, _MAX_CHARS = 64, 300                        # scalars kept per map, characters per string


class _ValueBuilder:
    """Parse events of one top-level JSON value (a response, or an array of them) -> `emit` of a Sequence or
    Forward as each response ends. Nothing of a response is built but its scalars and the few fields read
    (so a large logprobs or text costs nothing); its `routed_experts` stream through `_NestedIds`."""

    def __init__(self, label: str, options: RoutingOptions, emit: Callable):
        self.label, self.options, self.emit = label, options, emit
        self.stack: list[_Frame] = []
        self.has_root, self.root = False, None
        self.details, self.overflow = None, False
        self.nested: _NestedIds | None = None
        self.routed: list = []   # (path, _Routed, owner values) of the response being read

    def done(self) -> bool:
        return self.has_root and not self.stack and self.nested is None

    def event(self, prefix: str, ev: str, value) -> None:
        if self.nested is not None:
            if self.nested.event(ev, value):
                self.nested = None
            return
        top = self.stack[-1] if self.stack else None
        if ev == "map_key":
            top.cur = value
            return
        if ev in ("end_map", "end_array"):
            self._close()
            return
        if not self.stack:
            self.has_root = True
        if top is not None and top.is_map and top.cur == "routed_experts":
            self._routed(ev, value, top)
            return
        if ev in ("start_map", "start_array"):
            place = top.cur if top is not None and top.is_map else (top.count if top is not None else None)
            self.stack.append(_Frame(ev == "start_map", place, keep=place in _KEPT_LISTS))
            return
        if top is None:
            return
        if top.is_map:
            if len(top.values) < _MAX_KEYS:
                top.values[top.cur] = value[:_MAX_CHARS] if isinstance(value, str) else value
        else:
            top.count += 1
            if top.keep:
                top.values.append(value)

    def _routed(self, ev: str, value, owner: _Frame) -> None:
        routed = _Routed()
        path = tuple(f.place for f in self.stack[self._response_depth() + 1:])
        self.routed.append((path, routed, owner.values))
        if ev == "start_array":
            self.nested = _NestedIds(routed)
            self.nested.event(ev, value)
        else:
            routed.complete = True
            if ev == "string":
                routed.payload = value
            else:
                routed.problem = ("routed_experts is null (the server ran without returning routed experts?)"
                                  if ev == "null" else f"routed_experts is a {ev}, not expert ids")

    def _response_depth(self) -> int:
        """Where responses sit in the stack: the top-level value, or the items of a top-level array."""
        return 1 if self.stack and not self.stack[0].is_map else 0

    def _close(self) -> None:
        frame = self.stack.pop()
        parent = self.stack[-1] if self.stack else None
        if parent is not None:
            if not parent.is_map:
                parent.count += 1
            elif frame.is_map and frame.place in _LINKED:
                parent.values[frame.place] = frame.values
            elif not frame.is_map:
                parent.values[frame.place] = frame.values if frame.keep else range(frame.count)
        if frame.is_map and len(self.stack) == self._response_depth() and (parent is None or not parent.is_map):
            self._response(frame.values, self._where(parent))

    def _where(self, parent: _Frame | None) -> str:
        return f"{self.label}, item {parent.count - 1}" if parent is not None else self.label

    def finish_cut(self) -> None:
        """The value was cut: what of its response had ended is still read."""
        d = self._response_depth()
        if len(self.stack) > d and self.stack[d].is_map:
            where = f"{self.label}, item {self.stack[0].count}" if d else self.label
            self._response(self.stack[d].values, where, cut=True)

    def _response(self, values: dict, where: str, cut: bool = False) -> None:
        routed, self.routed = self.routed, []
        if "experts_touched" in values and ("accepted" in values or "root_token" in values):
            if not cut:
                self.emit(_trace_forward(values, where))
            return
        model = values.get("model") if isinstance(values.get("model"), str) else None
        for path, r, owner in routed:
            if r.complete:
                fmt = SGLANG if "meta_info" in path or "sglext" in path else VLLM
                label = where + "".join(f"[{p}]" if isinstance(p, int) else f", {p}" for p in path if p is not None)
                self.emit(_sequence(r, fmt, label, model, _token_count(values, owner), self.options))


def _token_count(response: dict, owner: dict) -> int | None:
    """Prompt + completion tokens of the sequence (SGLang's meta_info, else the response's usage)."""
    for info in (owner if "prompt_tokens" in owner else None, response.get("meta_info"), response.get("usage")):
        if isinstance(info, dict):
            p, c = info.get("prompt_tokens"), info.get("completion_tokens")
            if isinstance(p, int) and isinstance(c, int):
                return p + c
    return None


def _sequence(routed: _Routed, fmt: str, where: str, model, tokens: int | None, options: RoutingOptions) -> Sequence:
    if routed.problem or routed.payload is None and routed.ids is None:
        return Sequence(where, fmt, None, routed.problem or "routed_experts holds nothing", model)
    if routed.ids is not None:
        return Sequence(where, fmt, routed.ids, model=model)
    try:
        raw = base64.b64decode(routed.payload, validate=True)
    except (binascii.Error, ValueError):
        return Sequence(where, fmt, None, "routed_experts is a string but not base64", model)
    if raw.startswith(NPY_MAGIC):
        try:
            ids = np.load(io.BytesIO(raw), allow_pickle=False)
        except (ValueError, OSError) as e:
            return Sequence(where, fmt, None, f"routed_experts is not a readable .npy payload ({e})", model)
        if not np.issubdtype(ids.dtype, np.integer):
            return Sequence(where, fmt, None, f"routed_experts holds {ids.dtype} values, not expert ids", model)
        if ids.ndim != 3:
            return Sequence(where, fmt, None, f"routed experts are {list(ids.shape)}, not [tokens, layers, k] "
                                              f"(wrong rank)", model)
        return Sequence(where, fmt, ids, model=model)
    return _flat_int32(raw, fmt, where, model, tokens, options)


def _flat_int32(raw: bytes, fmt, where, model, tokens, options: RoutingOptions) -> Sequence:
    """SGLang's payload: the int32 ids of [tokens − 1, layers, k] laid flat."""
    if len(raw) % 4:
        return Sequence(where, fmt, None, f"routed_experts decodes to {len(raw)} bytes, not int32 ids", model)
    flat = np.frombuffer(raw, dtype="<i4")
    if not tokens or tokens < 2:
        return Sequence(where, fmt, None, "flat routed_experts without the token counts (meta_info.prompt_tokens "
                                          "and completion_tokens) to shape it", model)
    rows = tokens - 1  # the last token was never fed back, so it routed nowhere
    if len(flat) % rows:
        return Sequence(where, fmt, None, f"{len(flat)} routed expert ids do not split into {rows} tokens "
                                          f"(prompt + completion − 1)", model)
    per_token = len(flat) // rows
    k, inferred = options.top_k, False
    if k is None:
        k, inferred = _infer_k(flat.reshape(rows, per_token)), True
    if per_token % k:
        return Sequence(where, fmt, None, f"{per_token} ids per token do not split into layers of --top-k {k}", model)
    return Sequence(where, fmt, flat.reshape(rows, per_token // k, k), model=model, k_inferred=inferred)


def _infer_k(per_token: np.ndarray) -> int:
    """The largest k dividing a token's ids for which every group of k (one layer's picks) is distinct or all
    zero (a dense layer's placeholder): a group spanning two layers repeats an expert somewhere."""
    n = per_token.shape[1]
    for k in sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True):
        g = np.sort(per_token.reshape(len(per_token), n // k, k), axis=2)
        zero = (g == 0).all(axis=2)
        distinct = (g[:, :, 1:] != g[:, :, :-1]).all(axis=2)
        if (zero | distinct).all():
            return k
    return 1


def _trace_forward(row: dict, where: str) -> Forward:
    touched = row.get("experts_touched")
    if touched is None:
        return Forward(where, TRACES, None, problem="dense")
    if not isinstance(touched, list) or not all(isinstance(x, int) and x >= 0 for x in touched):
        return Forward(where, TRACES, None, problem="experts_touched is not a count per MoE layer")
    try:
        tokens = verify_tokens(row)
    except (TypeError, ValueError):
        return Forward(where, TRACES, None, problem="the round's verify tokens are not a count")
    return Forward(where, TRACES, tokens, touched=touched)


# ----------------------------------------------------------------------------- files
def is_candidate(head: bytes) -> str | None:
    """'json' when a routing field is in the file's first bytes, 'pt' for a torch.save archive, else None."""
    if head.startswith(b"PK\x03\x04"):
        return "pt"
    return "json" if any(m in head for m in MARKERS) else None


def has_marker(path: Path) -> bool:
    """Whether a routing field name occurs anywhere in the file (read in chunks)."""
    tail, longest = b"", max(len(m) for m in MARKERS)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            buf = tail + chunk
            if any(m in buf for m in MARKERS):
                return True
            tail = buf[-longest:]
    return False


def read_items(path: Path, kind: str, options: RoutingOptions, emit: Callable, note: Callable) -> bool:
    """Every item of a routing dump, in file order -> emit(item); a cut or a value that is not JSON -> note(where,
    error, cut). False for a .pt archive that is no recorder dump."""
    if kind == "pt":
        return _pt_items(path, options, emit, note)
    _json_items(path, options, emit, note)
    return True


def _json_items(path: Path, options: RoutingOptions, emit: Callable, note: Callable) -> None:
    """Every response of a JSON file -> emit; a value cut short or not JSON -> note(where, error, cut)."""
    with open(path, "rb") as f:
        lines = is_json_lines(f.read(8192))
        f.seek(0)
        made: list[_ValueBuilder] = []
        count = [0]

        def make():  # one builder per line (or per document), in file order; the last one is the one cut
            count[0] += 1
            made[:] = [_ValueBuilder(f"line {count[0]}" if lines else f"value {count[0]}", options, emit)]
            return made[0]

        for p in (read_lines if lines else read_document)(f, None, make):
            if p.error:
                if made and made[-1].has_root:
                    made[-1].finish_cut()
                note(f"line {p.line}" if lines else f"value {p.line}", p.error, p.incomplete)


def _pt_items(path: Path, options: RoutingOptions, emit: Callable, note: Callable) -> bool:
    """SGLang's expert-distribution recorder dump -> emits; False when the archive is no such dump."""
    try:
        import torch
    except ImportError:
        raise RoutingRefusal("a .pt dump needs torch to read (pip install torch)") from None
    try:
        data = torch.load(str(path), map_location="cpu", weights_only=True)  # plain data: no code runs
    except Exception as e:  # noqa: BLE001 - torch's own errors for files it cannot read; name the file instead
        raise RoutingRefusal(f"not a readable torch.save file ({str(e).splitlines()[0][:160]})") from None
    if not isinstance(data, dict):
        return False
    if "logical_count" in data:  # stat: [passes, layers, E] tokens per expert
        counts = data["logical_count"].numpy()
        if counts.ndim == 2:
            counts = counts[None]
        for i, c in enumerate(counts):
            emit(_counts_forward(c, f"pass {i}", options))
        return True
    records = data.get("records")
    if not isinstance(records, list):
        return False
    to_logical = data.get("last_physical_to_logical_map")
    to_logical = None if to_logical is None else to_logical.numpy()
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            continue
        where = f"pass {rec.get('forward_pass_id', i)}" + (f", rank {rec['rank']}" if "rank" in rec else "")
        if "topk_ids_of_layer" in rec:
            for item in _per_token_items(rec, to_logical, where):
                emit(item)
        elif "global_physical_count" in rec:
            counts = rec["global_physical_count"].numpy()
            if to_logical is not None:  # physical slots -> the logical experts they hold
                top = int(to_logical.max()) + 1
                counts = np.stack([np.bincount(to_logical[l], weights=counts[l], minlength=top)
                                   for l in range(counts.shape[0])])
            emit(_counts_forward(counts, where, options))
    return True


def _counts_forward(counts: np.ndarray, where: str, options: RoutingOptions) -> Forward:
    if options.top_k is None:
        raise RoutingRefusal("per-pass expert counts (the recorder's stat and per_pass modes) give no tokens per "
                             "pass without --top-k")
    routed = counts.sum(axis=1)
    moe = routed[routed > 0]
    return Forward(where, SGLANG_RECORDER, int(moe.max() // options.top_k) if len(moe) else 0, counts=counts,
                   experts=counts.shape[1])


def _per_token_items(rec: dict, to_logical, where: str) -> Iterator:
    ids = rec["topk_ids_of_layer"].numpy().astype(np.int64)  # [layers, tokens, slots], −1 where no pick
    if to_logical is not None:
        ids = np.where(ids >= 0, np.take_along_axis(to_logical, np.maximum(ids, 0).reshape(len(ids), -1), 1)
                       .reshape(ids.shape), -1)
    ids = ids.transpose(1, 0, 2)  # [tokens, layers, slots]
    picks = (ids >= 0).sum(axis=2)
    routed = picks[:, picks.max(axis=0) > 0] if picks.size else picks
    if routed.size == 0:
        return
    k = int(routed.max())
    if (routed != k).any():
        yield Forward(where, SGLANG_RECORDER, None, problem="inconsistent k across tokens in this pass")
        return
    ids = np.where(ids[:, :, :k] >= 0, ids[:, :, :k], 0)  # a layer without picks reads as the dense placeholder
    yield Forward(where, SGLANG_RECORDER, len(ids), ids=ids,
                  experts=None if to_logical is None else int(to_logical.max()) + 1)
    lens, pos = rec.get("extend_seq_lens"), rec.get("positions")
    if isinstance(lens, list) and isinstance(pos, list) and sum(lens) == len(ids) == len(pos):
        start = 0
        for r, n in enumerate(lens):
            p = np.asarray(pos[start:start + n])
            if n >= 2 and (np.diff(p) == 1).all():  # one request's consecutive prompt tokens
                yield Sequence(f"{where}, chunk {r}", SGLANG_RECORDER, ids[start:start + n])
            start += n


class RoutingRefusal(Exception):
    """A routing dump that cannot be read at all: one line, the file is named by the caller."""
