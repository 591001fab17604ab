"""A layer's kernels and GPU time from two `bench profile` JSONs of one random shape at two depths: each row's
difference ÷ the layers between them, so the embedding, the head, the drafter and the host's work cancel and what
is left is exactly what one more layer launches and takes (a compiled layer's kernels, say, which only a GPU shows).

    python -m ddtree_lab.bench.layers SHALLOW.json DEEP.json [--out layers.json]

SHALLOW and DEEP profile random:<shape>@D1 and random:<shape>@D2 (D1 < D2) with the same settings. Rows pair up by
(method, budget). Per row: kernels and µs a layer, per stage, and per (stage, kernel name) for the kernels both
files list (every kernel, in profiles written since `top_kernels` lists them all; the larger ones in older files).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..atomic import atomic_write_json
from ..pairs.random import DEPTH_SEPARATOR, WEIGHT_SETS_SEPARATOR, split_shape_name

SAME = ("dtype", "attention", "compile", "prompt_len", "tree_kernels", "routing")  # settings both profiles share


def depth_of(model: str) -> tuple[str, int]:
    """'random:<shape>@D' -> ('random:<shape>', D), and 'random:<shape>@D~S' -> ('random:<shape>~S', D);
    ValueError for a model without a depth."""
    prefix, _, shape = (model or "").partition("random:")
    parts = split_shape_name(shape) if not prefix else None
    if not parts or parts[1] is None:
        raise ValueError(f"model {model!r}: not a random shape at a given depth (random:<shape>{DEPTH_SEPARATOR}D)")
    base, depth, sets = parts
    return "random:" + base + ("" if sets is None else f"{WEIGHT_SETS_SEPARATOR}{sets}"), depth


def per_layer(shallow: dict, deep: dict) -> dict:
    """Two profile JSONs (dicts) of one shape at two depths -> {"model", "layers": (D1, D2), "rows": [...]}, each
    row's kernels and µs a layer, per stage and per kernel. ValueError naming what does not match."""
    (base1, d1), (base2, d2) = depth_of(shallow.get("model")), depth_of(deep.get("model"))
    if base1 != base2:
        raise ValueError(f"two shapes: {shallow['model']} and {deep['model']}")
    if d1 >= d2:
        raise ValueError(f"depths {d1} and {d2}: the second profile must be of the deeper model")
    differ = [f"{k} ({shallow.get(k)!r} vs {deep.get(k)!r})" for k in SAME if shallow.get(k) != deep.get(k)]
    if differ:
        raise ValueError("the profiles ran with other settings: " + ", ".join(differ))
    key = lambda r: (r["method"], r.get("budget"))  # noqa: E731
    shallow_rows = {key(r): r for r in shallow["rows"]}
    missing = [k for k in map(key, deep["rows"]) if k not in shallow_rows]
    if missing:
        raise ValueError(f"rows of the deeper profile without a shallower one: {missing}")
    n = d2 - d1
    rows = []
    for deep_row in deep["rows"]:
        a = shallow_rows[key(deep_row)]
        stages = {s: {"kernels": (v["kernels_per_round"] - a["stages"].get(s, {}).get("kernels_per_round", 0)) / n,
                      "us": (v["us_per_round"] - a["stages"].get(s, {}).get("us_per_round", 0)) / n}
                  for s, v in deep_row["stages"].items()}
        listed = {(k["stage"], k["name"]): k for k in a["top_kernels"]}
        kernels = []
        for k in deep_row["top_kernels"]:
            b = listed.get((k["stage"], k["name"]))
            if b is None:
                continue
            count = (k["per_round"] - b["per_round"]) / n
            if count:
                kernels.append({"stage": k["stage"], "name": k["name"], "per_layer": count,
                                "us": (k["us_per_round"] - b["us_per_round"]) / n})
        rows.append({"method": deep_row["method"], "budget": deep_row.get("budget"),
                     "kernels": (deep_row["kernels_per_round"] - a["kernels_per_round"]) / n,
                     "us": (deep_row["us_per_round"] - a["us_per_round"]) / n, "stages": stages,
                     "top_kernels": sorted(kernels, key=lambda k: -k["us"])})
    return {"model": base1, "layers": [d1, d2], "rows": rows}


def table(result: dict) -> str:
    lines = [f"{result['model']}: a layer, from depths {result['layers'][0]} and {result['layers'][1]}"]
    for r in result["rows"]:
        lines.append(f"  {r['method']:6s} budget={r['budget']!s:5s} {r['kernels']:6.2f} kernels {r['us']:8.1f} us")
        for k in r["top_kernels"]:
            lines.append(f"      {k['per_layer']:5.2f} {k['us']:8.1f} us  {k['stage']:10s} {k['name'][:80]}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shallow", help="bench profile JSON of random:<shape>@D1")
    ap.add_argument("deep", help="bench profile JSON of random:<shape>@D2, D2 > D1, the same settings")
    ap.add_argument("--out", default=None, help="JSON written here")
    a = ap.parse_args(argv)
    docs = []
    for path in (a.shallow, a.deep):
        try:
            docs.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            ap.error(f"{path}: not a readable JSON file ({e.__class__.__name__})")
        if not isinstance(docs[-1], dict) or docs[-1].get("kind") != "profile":
            ap.error(f"{path}: not a bench profile JSON")
    try:
        result = per_layer(*docs)
    except ValueError as e:
        ap.error(str(e))
    print(table(result), file=sys.stderr)
    if a.out:
        atomic_write_json(a.out, {"shallow": a.shallow, "deep": a.deep, **result})
    return result


if __name__ == "__main__":
    main()
