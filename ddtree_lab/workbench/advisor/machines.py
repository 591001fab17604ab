"""What machines.json holds: every GPU the workbench knows (its name variants, spec bandwidth and, for the
advisor's profiles, dense bf16 FLOP/s, with their sources) with the one matcher from a device name to its
entry, and the calibration the cost model runs on (fitted once: calibration.py); the `measured` machine of a
bench JSON; an 8-GPU server's interconnect, and a user's own measured figures over the table's
(`machine_profile`)."""
from __future__ import annotations

import json
import math
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
    # FP32 FLOP/s of the SMs' own lanes (not the tensor cores): their issue rate, which prices ALU work such as
    # unpacking INT4 experts; None where the table has no figure
    fp32_flops: float | None = None


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
                       m["source"], m.get("url", ""), _float_or_none(m.get("fp32_flops")))
    roof = (bench or {}).get("roofline") or {}
    if not roof.get("copy_bytes_per_second"):
        raise AdvisorError("machine 'measured' needs a bench e2e JSON with roofline.copy_bytes_per_second "
                           "(ddtree-lab bench e2e on the GPU)")
    cal = cal or load_calibration()
    device = ((bench or {}).get("environment") or {}).get("device")
    flops, spec = roof.get("gemm_flops_per_second"), machine_for_device(device)
    if not flops:
        if spec not in profile_names():
            raise AdvisorError(f"machine 'measured': the bench JSON has no gemm_flops_per_second and its "
                               f"device {device!r} is no profile with FLOP/s ({', '.join(profile_names())})")
        flops = data[spec]["bf16_dense_flops"] * 1.0
    return Machine(MEASURED, f"measured ({device})", float(roof["copy_bytes_per_second"]) / cal.copy_over_spec,
                   float(flops), "copy bandwidth and GEMM throughput of the bench JSON",
                   fp32_flops=_float_or_none(data[spec].get("fp32_flops")) if spec else None)


def _float_or_none(v) -> float | None:
    return None if v is None else float(v)


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
    # INT4 experts' unpacking beyond reading them: bytes / (spec bandwidth × this) more (fused-MoE INT4 bench);
    # 0: not fitted, no such term
    moe_int4_unpack_over_bandwidth: float = 0.0
    moe_int4_block_seconds: float = 0.0  # and per row block of INT4 experts (same bench; 0: not fitted)
    machine: str = "h200"         # where the kernel-level terms were fitted (machines.json `calibration.machine`)
    # MLA attention beyond its latent bytes and FLOPs (`bench mla`): a time per call, and its bytes and FLOPs again
    # at these multiples of spec bandwidth and peak; 0: not fitted, no such term
    mla_call_seconds: float = 0.0
    mla_bytes_over_bandwidth: float = 0.0
    mla_flops_over_peak: float = 0.0
    settings: dict = field(default_factory=dict)
    # eager rounds (census): a matmul kernel's time beyond its bytes and FLOPs, in place of launch_seconds (a
    # skinny GEMM's tiles, split and reduction; 0: every kernel at launch_seconds)
    eager_matmul_seconds: float = 0.0
    # and a one-row matmul's (an AR step's, which the BLAS runs as a matrix-vector kernel, without a GEMM's tiles
    # and split; 0: priced as eager_matmul_seconds)
    eager_matvec_seconds: float = 0.0
    # compiled rounds: a kernel of a one-row (AR) step, which handles one token and is shorter than a tree's
    # (0: launch_seconds)
    one_row_launch_seconds: float = 0.0
    # compiled layers of a shape the census counted (`layer_census`: shape -> stage -> [extern kernels, fused runs] a
    # layer): kernels a layer = extern + this many a fused run (per stage; fitted so the dense profile's shape gives
    # its profiled count)
    kernels_per_fused_run: dict = field(default_factory=dict)
    layer_census: dict = field(default_factory=dict)
    # where a round's kernels come from: "profile" (the per-layer counts above, from compiled rounds' profiles) or
    # "census" (eager layers: bench/census.py counts each round's kernels and activation bytes)
    launches_from: str = "profile"


# machines.json's calibrations: compiled layers (the efficiency factors and kernel counts fitted on compiled
# rounds, with the kernel-level terms), and eager layers (the launch time and efficiencies fitted again with each
# round's census, over the same kernel-level terms)
CALIBRATIONS = {"compiled": "calibration", "eager": "eager_calibration"}


def load_calibration(kind: str = "compiled") -> Calibration:
    data = machines_data()
    cal = data["calibration"]
    if "fit" not in cal:
        raise AdvisorError(f"{MACHINES_FILE}: no calibration fit; run ddtree_lab.workbench.advisor.calibrate")
    if kind == "compiled":
        return Calibration(**cal["fit"], settings=cal.get("settings", {}), machine=cal.get("machine", "h200"),
                           layer_census=cal.get("layer_census", {}))
    if kind not in CALIBRATIONS:
        raise AdvisorError(f"calibration {kind!r}; known: {', '.join(CALIBRATIONS)}")
    eager = data.get(CALIBRATIONS[kind]) or {}
    if "fit" not in eager:
        raise AdvisorError(f"{MACHINES_FILE}: no {kind} calibration fit; run "
                           "ddtree_lab.workbench.advisor.calibrate_eager")
    return Calibration(**{**cal["fit"], **eager["fit"]}, settings=eager.get("settings", {}), launches_from="census",
                       machine=cal.get("machine", "h200"), layer_census=cal.get("layer_census", {}))


# ----------------------------------------------------------------------------- interconnects and overrides
@dataclass(frozen=True)
class Interconnect:
    """How one GPU of an 8-GPU server reaches the other seven (machines.json `interconnect` + `interconnects`)."""
    kind: str                  # nvlink | pcie
    title: str
    bandwidth: float           # bytes/s per GPU, each direction
    all_reduce_latency: float  # seconds, a small all-reduce over the 8 GPUs
    all_to_all_latency: float  # seconds, a small all-to-all (dispatch, combine), reduce-scatter or all-gather
    nvls: bool                 # the switch reduces all-reduces (NVLink SHARP)
    nvls_latency: float | None
    source: str
    url: str = ""


# What a user may set over the table (advise --set KEY=VALUE, --machine-file): key -> (field, SI per unit, unit).
OVERRIDES = {
    "bandwidth_gbps": ("bandwidth", 1e9, "GB/s memory bandwidth (spec-equivalent)"),
    "flops_tflops": ("flops", 1e12, "TFLOP/s dense bf16"),
    "fp32_tflops": ("fp32_flops", 1e12, "TFLOP/s FP32 on the SMs' own lanes (prices INT4 unpacking)"),
    "link_gbps": ("link_bandwidth", 1e9, "GB/s per GPU each way over the interconnect"),
    "all_reduce_latency_us": ("all_reduce_latency", 1e-6, "µs, a small all-reduce over the 8 GPUs"),
    "all_to_all_latency_us": ("all_to_all_latency", 1e-6, "µs, a small all-to-all, reduce-scatter or all-gather"),
    "nvls": ("nvls", None, "true/false: the switch reduces all-reduces"),
    "nvls_latency_us": ("nvls_latency", 1e-6, "µs, a small NVLS all-reduce"),
}
_LINK_KEYS = ("link_gbps", "all_reduce_latency_us", "all_to_all_latency_us")  # enough to price a layout
_CHIP_KEYS = ("bandwidth_gbps", "flops_tflops", "fp32_tflops")  # the GPU's own figures, not its interconnect's


def override_value(key: str, value) -> float | bool:
    """A user's figure for KEY, checked: a positive number (nvls: true/false)."""
    if key not in OVERRIDES:
        raise AdvisorError(f"unknown machine figure {key!r}; known: {', '.join(OVERRIDES)}")
    if key == "nvls":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text not in ("true", "false", "1", "0", "yes", "no"):
            raise AdvisorError(f"machine figure nvls={value!r}: give true or false")
        return text in ("true", "1", "yes")
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number <= 0:
        raise AdvisorError(f"machine figure {key}={value!r}: give a positive number ({OVERRIDES[key][2]})")
    return number


def parse_set(text: str) -> tuple[str, float | bool]:
    """`KEY=VALUE` (advise --set) -> (key, value)."""
    key, sep, value = str(text).partition("=")
    if not sep or not key.strip() or not value.strip():
        raise AdvisorError(f"--set {text!r}: give KEY=VALUE, KEY one of {', '.join(OVERRIDES)}")
    return key.strip(), override_value(key.strip(), value.strip())


def read_machine_file(path) -> dict[str, float | bool]:
    """A user's measured figures: a JSON or YAML mapping of OVERRIDES keys to values."""
    import yaml  # a JSON file is YAML too

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise AdvisorError(f"--machine-file {path}: not a readable JSON or YAML file ({e.__class__.__name__})") from None
    if not isinstance(data, dict) or not data:
        raise AdvisorError(f"--machine-file {path}: give a mapping of figures, e.g. {{\"link_gbps\": 50}}; "
                           f"known: {', '.join(OVERRIDES)}")
    return {str(k): override_value(str(k), v) for k, v in data.items()}


def get_interconnect(name: str) -> Interconnect | None:
    """A table entry's interconnect with its kind's latencies, None when the table has none for it."""
    data = machines_data()
    link = data["machines"].get(name, {}).get("interconnect")
    if not link:
        return None
    kind = data["interconnects"][link["kind"]]
    return Interconnect(link["kind"], link["title"], float(link["bandwidth_bytes_per_second"]),
                        float(kind["all_reduce_latency_seconds"]), float(kind["all_to_all_latency_seconds"]),
                        bool(link["nvls"]), kind.get("nvls_latency_seconds"),
                        f"{link['source']}. Latencies: {kind['source']}", link.get("url", ""))


def machine_profile(name: str, overrides: dict | None = None, origins: dict | None = None,
                    need_link: bool = False) -> tuple[Machine, Interconnect | None, dict]:
    """A named profile with the user's figures over the table's: (machine, interconnect or None, what was used:
    {key: {value, table, origin}} in the keys' units). overrides: {key: value}; origins: {key: where it came
    from}. need_link: refuse, in one line, a machine without interconnect figures (a layout needs them)."""
    overrides, origins = dict(overrides or {}), dict(origins or {})
    if name == MEASURED:
        raise AdvisorError("machine 'measured' has no interconnect or table figures to override; name a profile")
    m, link = get_machine(name), get_interconnect(name)
    table_si = {"bandwidth_gbps": m.bandwidth, "flops_tflops": m.flops, "fp32_tflops": m.fp32_flops}
    if link:
        table_si.update(link_gbps=link.bandwidth, all_reduce_latency_us=link.all_reduce_latency,
                        all_to_all_latency_us=link.all_to_all_latency, nvls=link.nvls, nvls_latency_us=link.nvls_latency)
    si = {k: overrides[k] * OVERRIDES[k][1] if k in overrides and k != "nvls" else overrides.get(k, table_si.get(k))
          for k in OVERRIDES}
    if link is None and any(k in overrides for k in OVERRIDES if k not in _CHIP_KEYS):
        missing = [k for k in _LINK_KEYS if k not in overrides]
        if missing:
            raise AdvisorError(f"machine {name!r} has no interconnect figures in machines.json; give "
                               f"{', '.join(missing)} too (advise --set KEY=VALUE)")
    if need_link and any(si[k] is None for k in _LINK_KEYS):
        raise AdvisorError(f"machine {name!r} ({m.title}) has no interconnect figures in machines.json, so a layout "
                           f"cannot be priced; give {', '.join(_LINK_KEYS)} (advise --set KEY=VALUE) or name one of "
                           f"{', '.join(n for n in profile_names() if get_interconnect(n))}")
    if si["nvls"] and si["nvls_latency_us"] is None:
        raise AdvisorError(f"machine {name!r}: nvls is on without an NVLS latency; give nvls_latency_us")
    machine = Machine(m.name, m.title, si["bandwidth_gbps"], si["flops_tflops"], m.source, m.url, si["fp32_tflops"])
    if si["link_gbps"] is not None:
        link = Interconnect(link.kind if link else "user", link.title if link else "the user's interconnect",
                            si["link_gbps"], si["all_reduce_latency_us"], si["all_to_all_latency_us"],
                            bool(si["nvls"]), si["nvls_latency_us"],
                            link.source if link else "the user's figures", link.url if link else "")

    def in_units(k, v):  # as a user writes them (12 digits: 15e-6 s reads 15 µs, not 15.000000000000002)
        return v if k == "nvls" or v is None else float(f"{v / OVERRIDES[k][1]:.12g}")

    record = {k: {"value": overrides[k] if k in overrides else in_units(k, table_si.get(k)),
                  "table": in_units(k, table_si.get(k)),
                  "origin": origins.get(k, "--set") if k in overrides else "machines.json"}
              for k in OVERRIDES if k in overrides or table_si.get(k) is not None}
    return machine, link, record
