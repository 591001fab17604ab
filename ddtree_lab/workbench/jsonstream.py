"""Streaming reader for benchmark result files: JSON lines or one JSON document, any size.

A record is built as a plain dict except for its per-request arrays (`DETAIL_KEYS`, at the top
level or under `details`), which are summarised while they stream past (`Details`), so a file of
many GB needs memory for one generated text at a time, not for the file.

Serving benchmarks write Python's `json.dumps` output, which allows the non-standard tokens
`NaN`, `Infinity` and `-Infinity`, and escapes a lone surrogate (text decoded with surrogateescape) as
`\\udcXX`. `_Prefilter` rewrites the tokens outside strings into marker strings, which the builder turns
back into floats, and a lone surrogate escape into U+FFFD, before the strict parser sees them. Bytes
that are not UTF-8 (a Latin-1 é in a generated text) become U+FFFD too (`_Utf8Repair`): one odd
character must not cost a record.
"""
from __future__ import annotations

import codecs
import re
import zlib
from dataclasses import dataclass, field
from typing import Iterator

import ijson

CHUNK = 1 << 16  # events of one chunk are held at once: keep them few
DETAIL_KEYS = frozenset({"input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors",
                         "latencies", "start_times", "queue_times", "cached_tokens", "cached_tokens_details"})
# A record is a benchmark summary, tens of fields; a document with far more values outside the
# detail arrays is some other kind of file, and building it would cost memory for nothing.
MAX_BUILT_VALUES = 200_000
SAMPLE_ERRORS = 3

_MARK = {b"NaN": b'"\\u0000NaN"', b"Infinity": b'"\\u0000Infinity"', b"-Infinity": b'"\\u0000-Infinity"'}
_UNMARK = {"\x00NaN": float("nan"), "\x00Infinity": float("inf"), "\x00-Infinity": float("-inf")}
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(")?|-?Infinity|NaN')  # group 1: the closing quote


# In a string: a surrogate pair (kept), a lone surrogate (replaced) or any other escape (kept; consuming
# it whole keeps an escaped backslash from being read as the start of an escape).
_ESCAPES = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
                      rb"|(\\u[dD][89a-fA-F][0-9a-fA-F]{2})|\\.")
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def _no_lone_surrogates(string: bytes) -> bytes:
    # the parser would hand a lone surrogate on as bytes that are not UTF-8 and fail the whole file
    if not _MAYBE_SURROGATE.search(string):
        return string
    return _ESCAPES.sub(lambda m: b"\\ufffd" if m.group(1) else m.group(), string)


class _Prefilter:
    """Byte stream -> the same stream with NaN / ±Infinity outside strings made marker strings and lone
    surrogate escapes inside strings made U+FFFD. Keeps back an unfinished string or a possibly cut
    token for the next chunk."""

    def __init__(self):
        self.carry = b""

    def feed(self, data: bytes, final: bool = False) -> bytes:
        buf, out, pos, last = self.carry + data, [], 0, 0
        self.carry = b""
        for m in _TOKENS.finditer(buf):
            tok, last = m.group(), m.end()
            if tok[:1] == b'"':
                if m.group(1) is None and not final:
                    out.append(buf[pos:m.start()])  # a string cut by the chunk end: keep it whole
                    self.carry = buf[m.start():]
                    return b"".join(out)
                fixed = _no_lone_surrogates(tok)
                if fixed is not tok:
                    out += [buf[pos:m.start()], fixed]
                    pos = m.end()
                continue
            out.append(buf[pos:m.start()])
            out.append(_MARK[tok])
            pos = m.end()
        # after the last string or token only plain JSON is left; its end may be a cut "-Infin"
        cut = len(buf) if final else max(pos, last, len(buf) - 9)
        out.append(buf[pos:cut])
        self.carry = buf[cut:]
        return b"".join(out)


class _Utf8Repair:
    """Byte stream -> the same stream with every byte sequence that is not UTF-8 made U+FFFD (the
    parser refuses them, and with them the whole record); a character cut by the chunk end waits."""

    def __init__(self):
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, data: bytes, final: bool = False) -> bytes:
        return self.decoder.decode(data, final).encode("utf-8")


@dataclass
class Details:
    """What the per-request arrays say, without keeping them."""
    counts: dict = field(default_factory=dict)      # key -> number of items
    errors: int = 0                                 # non-empty error strings
    error_samples: list = field(default_factory=list)
    texts: int = 0
    degenerate: dict = field(default_factory=dict)  # why -> count (see ingest.degenerate_reason)
    output_lens_sum: int = 0
    output_lens_zero: int = 0

    def n(self, key: str) -> int | None:
        return self.counts.get(key)


class RecordBuilder:
    """ijson parse events of one top-level value -> `root` (plain data) and `details`."""

    def __init__(self, judge_text):
        self.stack: list = []
        self.keys: list = []
        self.root = None
        self.has_root = False
        self.details = Details()
        self.judge_text = judge_text
        self.built = 0
        self.overflow = False
        self.skip: str | None = None   # the detail key whose value is streaming past
        self.depth = 0                 # nesting inside that value

    def done(self) -> bool:
        return self.has_root and not self.stack and self.skip is None

    def event(self, prefix: str, ev: str, value) -> None:
        if self.skip is not None:
            if ev in ("start_map", "start_array"):
                self.depth += 1
            elif ev in ("end_map", "end_array"):
                self.depth -= 1
            self._detail(self.skip, ev, value)
            if self.depth == 0:
                self.skip = None
            return
        if ev == "map_key" and value in DETAIL_KEYS and (
                len(self.stack) == 1 or (len(self.stack) == 2 and self.keys[0] == "details")):
            self.skip, self.depth = value, 0   # its array goes to the summary, not into the record
            return
        self._build(ev, value)

    def _detail(self, key: str, ev: str, value) -> None:
        d, depth = self.details, self.depth
        if ev in ("start_map", "start_array"):
            if depth == 1:
                d.counts.setdefault(key, 0)
            elif depth == 2:                      # a list or map per request (itls)
                d.counts[key] = d.counts.get(key, 0) + 1
            return
        if ev in ("end_map", "end_array", "map_key") or depth != 1:
            return
        d.counts[key] = d.counts.get(key, 0) + 1
        if key == "errors" and isinstance(value, str) and value.strip():
            d.errors += 1
            if len(d.error_samples) < SAMPLE_ERRORS and value[:300] not in d.error_samples:
                d.error_samples.append(value[:300])
        elif key == "generated_texts" and isinstance(value, str):
            d.texts += 1
            why = self.judge_text(value)
            if why:
                d.degenerate[why] = d.degenerate.get(why, 0) + 1
        elif key == "output_lens" and isinstance(value, (int, float)):
            d.output_lens_sum += int(value)
            d.output_lens_zero += int(value) == 0

    def _build(self, ev: str, value) -> None:
        if ev == "map_key":
            self.keys[-1] = value
            return
        if ev in ("end_map", "end_array"):
            self.stack.pop()
            self.keys.pop()
            return
        if ev in ("start_map", "start_array"):
            new = None if self.overflow else ({} if ev == "start_map" else [])
            self._put(new)
            self.stack.append(new)
            self.keys.append(None)
            return
        if ev == "string" and value in _UNMARK:
            value = _UNMARK[value]
        self.built += 1
        if self.built > MAX_BUILT_VALUES:
            self.overflow = True   # keep following the structure, stop keeping values
        self._put(value)

    def _put(self, v) -> None:
        if not self.stack:
            self.root, self.has_root = v, True
        elif self.overflow or self.stack[-1] is None:
            return
        elif isinstance(self.stack[-1], list):
            self.stack[-1].append(v)
        else:
            self.stack[-1][self.keys[-1]] = v


@dataclass
class Parsed:
    """One top-level value of a file; `error` is set when it did not parse to its end."""
    line: int
    value: object
    details: Details
    error: str | None = None
    incomplete: bool = False   # the input ended inside the value (as opposed to a syntax error)
    overflow: bool = False
    size: int = 0


def _parser(builder_events):
    return ijson.parse_coro(builder_events, use_float=True)


def _finish(coro, events, builder) -> tuple[str | None, bool]:
    try:
        coro.close()
    except ijson.common.IncompleteJSONError as e:
        _drain(events, builder)
        msg = str(e).splitlines()[0].strip()
        return msg, "premature EOF" in msg or "incomplete" in msg.lower()
    _drain(events, builder)
    return None, False


def _drain(events, builder) -> None:
    for prefix, ev, value in events:
        builder.event(prefix, ev, value)
    del events[:]


def read_lines(f, judge_text, make_builder=None) -> Iterator[Parsed]:
    """JSON lines from a binary file object: one Parsed per non-blank line, in bounded memory. `make_builder`
    (default: a RecordBuilder) makes what each line's parse events go to: anything with `event(prefix, ev,
    value)`, `done()`, `root`, `details` and `overflow` (routing dumps stream their expert ids that way)."""
    line_no = 0
    state = None  # [coro, events, builder, filter, size, blank, error, repair]

    def start():
        events = ijson.sendable_list()
        builder = make_builder() if make_builder else RecordBuilder(judge_text)
        return [_parser(events), events, builder, _Prefilter(), 0, True, None, _Utf8Repair()]

    def send(st, data: bytes, final: bool = False) -> None:
        st[4] += len(data)
        if st[5] and data.strip():
            st[5] = False
        if st[6] is not None:
            return  # this line already failed; skip the rest of it
        out = st[3].feed(st[7].feed(data, final), final)  # each line repaired on its own: none spills over
        try:
            if out:  # an empty send means end of input to the parser
                st[0].send(out)
        except ijson.common.IncompleteJSONError as e:
            st[6] = str(e).splitlines()[0].strip()
        _drain(st[1], st[2])

    def end(st, no) -> Parsed | None:
        send(st, b"", final=True)
        if st[5]:
            return None
        if st[6] is not None:
            err, incomplete = st[6], False
        else:
            err, incomplete = _finish(st[0], st[1], st[2])
        b = st[2]
        return Parsed(no, b.root, b.details, err, incomplete, b.overflow, st[4])

    while True:
        chunk = f.read(CHUNK)
        if not chunk:
            break
        parts = chunk.split(b"\n")
        for i, part in enumerate(parts):
            if state is None:
                state = start()
                line_no += 1
            send(state, part)
            if i < len(parts) - 1:  # a newline followed this part
                p = end(state, line_no)
                state = None
                if p is not None:
                    yield p
    if state is not None:
        p = end(state, line_no)
        if p is not None:
            yield p


def read_document(f, judge_text, make_builder=None) -> Iterator[Parsed]:
    """The whole file as one or more JSON documents (pretty-printed, several per file); `make_builder` as for
    read_lines."""
    events = ijson.sendable_list()
    coro = ijson.parse_coro(events, use_float=True, multiple_values=True)
    flt, fix, n, size = _Prefilter(), _Utf8Repair(), 0, 0
    new_builder = make_builder or (lambda: RecordBuilder(judge_text))
    builder = new_builder()
    err = None

    def flush():
        nonlocal builder, n
        for prefix, ev, value in events:
            builder.event(prefix, ev, value)
            if builder.done():
                n += 1
                yield Parsed(n, builder.root, builder.details, None, False, builder.overflow, size)
                builder = new_builder()
        del events[:]

    while err is None:
        chunk = f.read(CHUNK)
        size += len(chunk)
        out = flt.feed(fix.feed(chunk, final=not chunk), final=not chunk)
        try:
            if out:  # an empty send means end of input to the parser
                coro.send(out)
        except ijson.common.IncompleteJSONError as e:
            err = str(e).splitlines()[0].strip()
        yield from flush()
        if not chunk:
            break
    incomplete = False
    if err is None:
        try:
            coro.close()
        except ijson.common.IncompleteJSONError as e:
            err = str(e).splitlines()[0].strip()
            incomplete = True
        yield from flush()
    if err is not None and (builder.stack or builder.has_root or incomplete):
        yield Parsed(n + 1, builder.root, builder.details, err, incomplete or "premature EOF" in err,
                     builder.overflow, size)
    elif err is not None:
        yield Parsed(n + 1, None, builder.details, err, False, False, size)


def read_values(f, head: bytes, judge_text, make_builder=None) -> Iterator[Parsed]:
    """A file's top-level JSON values: JSON lines, unless the first line (of `head`, the file's first bytes)
    opens a value that goes on over the next lines (a pretty-printed document): then read_document."""
    reader = read_lines if is_json_lines(head) else read_document
    yield from reader(f, judge_text, make_builder)


def is_json_lines(head: bytes) -> bool:
    """Whether a file starting with `head` is JSON lines: false when its first line opens a value that goes
    on over the next lines."""
    first, nl, rest = head.partition(b"\n")
    if nl and rest.strip():
        p = next(read_lines(_Prefix(first), lambda text: None), None)
        return not (p is not None and p.incomplete)
    return True


class _Prefix:
    """A bytes value read like a file (the first line, tried on its own)."""

    def __init__(self, data: bytes):
        self.data = data

    def read(self, n: int) -> bytes:
        out, self.data = self.data[:n], self.data[n:]
        return out


def compress_ratio(text: str) -> float:
    data = text.encode("utf-8", "replace")
    return len(zlib.compress(data, 6)) / max(1, len(data))
