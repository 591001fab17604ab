"""What the model cards share: the cached engine evaluation, the τ table and the bars a pair must meet."""
from __future__ import annotations

import json
from pathlib import Path


def read_summary(work: Path, name: str) -> dict:
    """work/<name>.json, or {} when that stage has not run."""
    f = work / f"{name}.json"
    return json.loads(f.read_text()) if f.exists() else {}


def cached_evaluation(work: Path, measure, log=print) -> dict:
    """The engine evaluation is the slow part of a card: kept in work/card_eval.json, so that the card can
    be rewritten without it (delete the file to measure again)."""
    path = work / "card_eval.json"
    if path.exists():
        log(f"card: reusing the engine evaluation in {path} (delete it to measure again)")
        return json.loads(path.read_text())
    ev = measure()
    path.write_text(json.dumps(ev, indent=1) + "\n")
    return ev


def slim(ev: dict) -> dict:
    """A pooled evaluation (evaluate.pooled) without its sample outputs: what eval.json ships."""
    return {"overall_tau": ev["overall_tau"], "lossless": ev["lossless"],
            "sets": {k: {kk: vv for kk, vv in v.items() if kk != "samples"} for k, v in ev["sets"].items()}}


def tau_table(ev: dict, budgets, checked: bool = True) -> str:
    """checked=False: outputs were sampled (T > 0), so the equality column reads n/a."""
    methods = ["dflash"] + [f"ddtree{b}" for b in budgets]
    head = "| prompt set | DFlash | " + " | ".join(f"DDTree({b})" for b in budgets) + " | DDTree(64) / DFlash | output == AR |"
    sep = "|" + "---|" * (len(methods) + 3)
    rows = [head, sep]
    entries = list(ev["sets"].items()) + [("all", {"tau": ev["overall_tau"], "mismatches": sum(
        (s["mismatches"] for s in ev["sets"].values()), [])})]
    for name, s in entries:
        t = s["tau"]
        ratio = t.get("ddtree64", float("nan")) / t["dflash"] if "ddtree64" in t else float("nan")
        ok = ("yes" if not s["mismatches"] else f"NO ({len(s['mismatches'])})") if checked else "n/a (sampled)"
        rows.append(f"| {name} | " + " | ".join(f"{t[m]:.2f}" for m in methods) + f" | {ratio:.2f} | {ok} |")
    return "\n".join(rows)


def tau_bars(ov: dict, lossless: bool, lossless_bar: str) -> list[tuple[str, bool, str]]:
    """(bar, met, value) for the acceptance every pair is held to, from pooled τ at T = 0."""
    return [
        ("DFlash mean τ ≥ 3.0", ov["dflash"] >= 3.0, f"{ov['dflash']:.2f}"),
        ("DDTree(64) ≥ 1.3 × DFlash", ov.get("ddtree64", 0) >= 1.3 * ov["dflash"],
         f"{ov.get('ddtree64', float('nan')) / ov['dflash']:.2f}×"),
        ("DDTree(256) ≥ DDTree(64)", ov.get("ddtree256", 0) >= ov.get("ddtree64", 1e9),
         f"{ov.get('ddtree256', float('nan')):.2f} vs {ov.get('ddtree64', float('nan')):.2f}"),
        (lossless_bar, lossless, "all prompts" if lossless else "mismatch"),
    ]


def bars_table(head: str, bars: list) -> str:
    return (f"| {head} | met | value |\n|---|---|---|\n"
            + "\n".join(f"| {b} | {'yes' if ok else 'NO'} | {v} |" for b, ok, v in bars))
