"""Machine profiles (machines.json: spec bandwidth and dense bf16 FLOP/s with their sources; the
`measured` machine of a bench JSON) and the calibration fitted once on H200."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

MACHINES_FILE = Path(__file__).with_name("machines.json")
MEASURED = "measured"


class AdvisorError(ValueError):
    """Bad advisor input: one line naming what is wrong."""


# ----------------------------------------------------------------------------- machines
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


def known_machines() -> list[str]:
    return [*machines_data()["machines"], MEASURED]


def _device_machine(device: str | None) -> str | None:
    """The profile a device name (e.g. 'NVIDIA H200') matches, by its model number."""
    d = (device or "").lower().replace(" ", "")
    for name in machines_data()["machines"]:
        key = name.replace("-", "")
        if key in d.replace("-", ""):
            return name
    return None


def get_machine(name: str, bench: dict | None = None, cal: "Calibration | None" = None) -> Machine:
    """A named profile, or `measured`: a bench JSON's copy bandwidth (converted to its spec equivalent
    with the calibration's copy/spec ratio) and its GEMM throughput, else its device's spec FLOP/s."""
    data = machines_data()["machines"]
    if name in data:
        m = data[name]
        return Machine(name, m["title"], float(m["bandwidth_bytes_per_second"]), float(m["bf16_dense_flops"]),
                       m["source"], m.get("url", ""))
    if name != MEASURED:
        raise AdvisorError(f"unknown machine {name!r}; known: {', '.join(known_machines())}")
    roof = (bench or {}).get("roofline") or {}
    if not roof.get("copy_bytes_per_second"):
        raise AdvisorError("machine 'measured' needs a bench e2e JSON with roofline.copy_bytes_per_second "
                           "(ddtree-lab bench e2e on the GPU)")
    cal = cal or load_calibration()
    device = ((bench or {}).get("environment") or {}).get("device")
    flops = roof.get("gemm_flops_per_second")
    if not flops:
        spec = _device_machine(device)
        if spec is None:
            raise AdvisorError(f"machine 'measured': the bench JSON has no gemm_flops_per_second and its "
                               f"device {device!r} matches no profile ({', '.join(data)})")
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
