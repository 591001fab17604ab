"""How much the expert-union telemetry costs a traced round on an MoE target: one read of every MoE layer's
counts after a traced DDTree(64) generation of random:qwen3-30b-a3b, against the round's time (run on a GPU:
`OUT=. python3 tools/moe_counting_overhead.py`; writes counting_overhead.json)."""
import json
import os
import statistics
import time

import torch

import ddtree_lab as dl

pair = dl.load_pair("random:qwen3-30b-a3b", device="cuda", dtype="bfloat16", attention="triton")
g = torch.Generator().manual_seed(0)
prompt = torch.randint(0, 150000, (512,), generator=g).tolist()
kw = dict(method="ddtree", budget=64, max_new_tokens=48, stop=[])
for _ in range(2):
    dl.generate(pair, prompt, trace=True, **kw)
rows = []
for rep in range(3):
    res = dl.generate(pair, prompt, trace=True, **kw)
    n = len(res.acceptance_lengths)
    round_s = sum(v for k, v in res.stage_seconds.items() if k != "other") / n
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50):
        pair.target.expert_routing()
    count_s = (time.perf_counter() - t) / 50
    rows.append({"round_ms": round_s * 1e3, "count_ms": count_s * 1e3, "share": count_s / round_s})
print(json.dumps(rows, indent=1))
json.dump(rows, open(os.environ["OUT"] + "/counting_overhead.json", "w"), indent=1)
print("median share", statistics.median(r["share"] for r in rows))
