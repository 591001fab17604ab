"""What machines.json holds: every GPU the workbench knows (its name variants, spec bandwidth and, for the
advisor's profiles, dense bf16 FLOP/s, with their sources) with the one matcher from a device name to its
entry, and the calibration the cost model runs on (fitted once: calibration.py); the `measured` machine of a
bench JSON."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

MACHINES_FILE = Path(__file__).with_name("machines.json")
MEASURED = "measured"


class AdvisorError(ValueError):
    """Bad advisor input: one line naming what is wrong."""


@dataclass(frozen=True)
class Machine:
    name: str
    title: str
    bandwidth: float      # bytes/s, spec-equivalent (a measured copy bandwidth is converted)
    flops: float          # dense bf16 FLOP/s
    source: str
    url: str = ""


def machines_data() -> dict:
    return json.loads(MACHINES_FILE.read_text())


def profile_names() -> list[str]:
    """The entries the advisor can price: those with a FLOP/s figure."""
    return [n for n, m in machines_data()["machines"].items() if m.get("bf16_dense_flops")]


def known_machines() -> list[str]:
    return [*profile_names(), MEASURED]


def _words(name: str) -> tuple[str, ...]:
    return tuple(re.findall(r"[a-z0-9]+", name.lower()))


def machine_for_device(device: str | None) -> str | None:
    """The entry a device name is ('NVIDIA H100 PCIe', 'NVIDIA H100 80GB HBM3', a file-name token 'h200', an
    entry's own name), else None. A name variant matches as a run of whole words, so an H200 is not an H20;
    the most specific match (most words, then letters) wins, so an H100 PCIe is not priced as the SXM part."""
    words = _words(device or "")
    best, rank = None, (0, 0)
    for name, entry in machines_data()["machines"].items():
        for variant in (name, *entry.get("names", ())):
            v = _words(variant)
            hit = v and any(words[i:i + len(v)] == v for i in range(len(words) - len(v) + 1))
            if hit and (len(v), len("".join(v))) > rank:
                best, rank = name, (len(v), len("".join(v)))
    return best


def spec_bandwidth(device: str | None) -> float | None:
    """The datasheet memory bandwidth (bytes/s) of the GPU a device name is, else None."""
    name = machine_for_device(device)
    return float(machines_data()["machines"][name]["bandwidth_bytes_per_second"]) if name else None


def check_machine_name(name: str) -> None:
    """Refuse, in one line, a machine the advisor cannot price: an unknown name, or a GPU of the table
    without a FLOP/s figure."""
    known = known_machines()
    if name in known:
        return
    entry = machines_data()["machines"].get(name)
    if entry:
        raise AdvisorError(f"machine {name!r} ({entry['title']}) has no FLOP/s figure in machines.json, so the "
                           f"advisor cannot price it; known: {', '.join(known)}")
    raise AdvisorError(f"unknown machine {name!r}; known: {', '.join(known)}")


def get_machine(name: str, bench: dict | None = None, cal: "Calibration | None" = None) -> Machine:
    """A named profile, or `measured`: a bench JSON's copy bandwidth (converted to its spec equivalent
    with the calibration's copy/spec ratio) and its GEMM throughput, else its device's spec FLOP/s."""
    check_machine_name(name)
    data = machines_data()["machines"]
    if name != MEASURED:
        m = data[name]
        return Machine(name, m["title"], float(m["bandwidth_bytes_per_second"]), float(m["bf16_dense_flops"]),
                       m["source"], m.get("url", ""))
    roof = (bench or {}).get("roofline") or {}
    if not roof.get("copy_bytes_per_second"):
        raise AdvisorError("machine 'measured' needs a bench e2e JSON with roofline.copy_bytes_per_second "
                           "(ddtree-lab bench e2e on the GPU)")
    cal = cal or load_calibration()
    device = ((bench or {}).get("environment") or {}).get("device")
    flops = roof.get("gemm_flops_per_second")
    if not flops:
        spec = machine_for_device(device)
        if spec not in profile_names():
            raise AdvisorError(f"machine 'measured': the bench JSON has no gemm_flops_per_second and its "
                               f"device {device!r} is no profile with FLOP/s ({', '.join(profile_names())})")
        flops = data[spec]["bf16_dense_flops"] * 1.0
    return Machine(MEASURED, f"measured ({device})", float(roof["copy_bytes_per_second"]) / cal.copy_over_spec,
                   float(flops), "copy bandwidth and GEMM throughput of the bench JSON")


@dataclass
class Calibration:
    """Efficiency factors fitted once on H200 (`calibrate`); stated in docs/workbench.md."""
    eta_bw: float                 # achieved fraction of spec bandwidth when streaming weights
    eta_flops: float              # achieved fraction of dense bf16 peak in the verify GEMMs
    launch_seconds: float         # per kernel in a captured round (launch gap + minimum kernel time)
    tree_node_seconds: float      # tree build per node (latency-bound; taken as machine-independent)
    commit_node_seconds: float    # commit per verified token (same)
    copy_over_spec: float         # measured copy bandwidth / spec bandwidth on the calibration machine
    kernels: dict = field(default_factory=dict)  # stage -> [per layer, fixed]
    p: float = 2.0                # memory and compute times combine as (M^p + C^p)^(1/p)
    tree_vocab_seconds: float = 0.0  # tree build per vocabulary entry of each drafted position (its top-k; same)
    moe_block_seconds: float = 0.0  # per MoE block beyond bytes and FLOPs (fused-MoE kernel bench)
    moe_pair_seconds: float = 0.0   # and per routed (token, expert) pair
    moe_sort_seconds: float = 0.0   # and the sort's two launches of its own, past a few tokens
    moe_reread_over_bandwidth: float = 1.0  # an expert's weights read again (L2) stream at this × spec bandwidth
    settings: dict = field(default_factory=dict)


def load_calibration() -> Calibration:
    cal = machines_data()["calibration"]
    if "fit" not in cal:
        raise AdvisorError(f"{MACHINES_FILE}: no calibration fit; run ddtree_lab.workbench.advisor.calibrate")
    return Calibration(**cal["fit"], settings=cal.get("settings", {}))
