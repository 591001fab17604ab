"""INT4 weight-only checkpoints in the compressed-tensors `pack-quantized` format (the `int4` extra).

    read_quantization(config, where) -> QuantSpec | None   config.json's quantization_config, or one refusal line
    is_quantized(spec, module_name, module="Linear") -> bool   its targets and ignore list, compressed-tensors' rules
    load_int4(tensors, prefix, spec, where) -> Int4Linear(packed, scale, zero, shape)   one linear's tensors, checked
    stack_int4(experts) -> kernels.int4.Int4Weights          experts stacked for the fused-MoE kernel
    int4_config(targets, ...) / quantize_state_dict(...) / write_int4_checkpoint(...)
        fixtures in the genuine format, made by compressed-tensors itself (its min-max qparams and compressor)

The layout (docs/engine-interfaces.md, "INT4 experts"): a linear [N, K] stores `weight_packed` int32 [N, K/8],
`weight_scale` [N, K/G], `weight_shape` [2] = (N, K) and, asymmetric, `weight_zero_point` int32 [ceil(N/8), K/G]
packed along N. Module names are the checkpoint's (a multimodal wrapper's prefix included), e.g.
"model.layers.3.mlp.experts.7.gate_proj". The config's parsing and name matching are compressed-tensors' own;
the engine runs only what the kernels do: 4-bit int weights, groups along K, no activation quantization.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

import torch

from .config import CheckpointError, ConfigError
from .kernels.int4 import VALUES_PER_WORD, Int4Weights, check_group
from .runtime import has_library, missing_library

FORMAT = "pack-quantized"
QUANT_METHOD = "compressed-tensors"
RUNS = "the engine runs compressed-tensors pack-quantized INT4 weight-only (w4a16, group strategy) checkpoints"
WEIGHT_TENSORS = ("weight_packed", "weight_scale", "weight_shape")  # plus weight_zero_point when asymmetric

# other quant_method values, as a reader would name them
_METHODS = {"fp8": "FP8", "awq": "AWQ", "gptq": "GPTQ", "mxfp4": "MXFP4", "bitsandbytes": "bitsandbytes",
            "hqq": "HQQ", "eetq": "EETQ", "fbgemm_fp8": "FP8 (fbgemm)", "torchao": "torchao", "quark": "Quark",
            "modelopt": "ModelOpt (NVFP4 / FP8)", "gguf": "GGUF"}
_FLOAT_FORMATS = {"nvfp4-pack-quantized": "NVFP4", "mxfp4-pack-quantized": "MXFP4", "mxfp6-pack-quantized": "MXFP6",
                  "mxfp8-quantized": "MXFP8"}


@dataclass(frozen=True)
class Int4Scheme:
    """One config group the engine runs: its targets (names, "re:" patterns or module classes), symmetric or not
    (a zero point a group), and the group size along K."""

    targets: tuple[str, ...]
    symmetric: bool
    group_size: int


@dataclass(frozen=True)
class QuantSpec:
    """What a checkpoint's quantization_config says, once checked: INT4 (num_bits 4, type int), strategy group,
    format pack-quantized, for the modules its schemes target and `ignore` does not name."""

    schemes: tuple[Int4Scheme, ...]
    ignore: tuple[str, ...] = ()
    num_bits: int = 4
    type: str = "int"
    strategy: str = "group"
    format: str = FORMAT

    def scheme_for(self, module_name: str, module: torch.nn.Module | str | None = "Linear") -> Int4Scheme | None:
        """The scheme that quantizes `module_name`, or None. `module`: the module, or its class name ("Linear": the
        projections and experts of the reference model; its router is not one), or None to match by name only.
        A name in `ignore` is never quantized; among schemes an exact name wins over a pattern over a class, as
        compressed-tensors orders them."""
        if _matches(module_name, module, self.ignore):
            return None
        for rank in ("name", "re", "class"):
            for scheme in self.schemes:
                if _matches(module_name, module, [t for t in scheme.targets if _rank(t) == rank]):
                    return scheme
        return None


class Int4Linear(NamedTuple):
    """One linear's stored tensors: packed int32 [N, K/8], scale [N, K/G], zero int32 [ceil(N/8), K/G] or None,
    shape (N, K)."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    shape: tuple[int, int]


def _require(what: str) -> None:
    if not has_library("compressed_tensors"):
        raise ConfigError(missing_library(what, "compressed-tensors"))


def _rank(target: str) -> str:
    if target.startswith("re:"):
        return "re"
    return "class" if target[:1].isupper() and "." not in target else "name"


def _matches(name: str, module, targets: Iterable[str]) -> bool:
    from compressed_tensors.utils.match import is_match, match_name

    targets = list(targets)
    if isinstance(module, torch.nn.Module):
        return is_match(name, module, targets)
    return any(match_name(name, t) or (module is not None and _rank(t) == "class" and t == module) for t in targets)


def is_quantized(spec: QuantSpec | None, module_name: str, module: torch.nn.Module | str | None = "Linear") -> bool:
    """Whether the checkpoint stores `module_name` as INT4 (QuantSpec.scheme_for)."""
    return spec is not None and spec.scheme_for(module_name, module) is not None


# ----------------------------------------------------------------------------- the config

def _other_method(qc: dict) -> str:
    method = str(qc.get("quant_method"))
    name = _METHODS.get(method.lower(), f"quant_method '{method}'")
    if method.lower() == "fp8" and qc.get("weight_block_size"):
        name = f"FP8 block-quantized weights (weight_block_size {qc['weight_block_size']})"
    if method.lower() == "gptq" and qc.get("desc_act"):
        name = "GPTQ with act-order (desc_act)"
    return name


def _bits(args) -> str:
    return f"{args.type}{args.num_bits}"


def _scheme_problem(scheme, fmt: str) -> str | None:
    """What in one config group the engine does not run, or None."""
    w = scheme.weights
    if w is None:
        return "no weight quantization"
    if w.type != "int":
        if fmt in _FLOAT_FORMATS:
            return f"{_FLOAT_FORMATS[fmt]} weights"
        if w.num_bits == 8:
            return (f"FP8 weights in {w.block_structure} blocks" if w.strategy == "block"
                    else f"FP8 weights (per {w.strategy})")
        return f"float{w.num_bits} weights"
    if w.num_bits != 4:
        return f"int{w.num_bits} weights (num_bits {w.num_bits}; only 4)"
    for kind, act in (("input", scheme.input_activations), ("output", scheme.output_activations)):
        if act is not None:
            how = "dynamic" if act.dynamic else "static"
            return f"{how} {kind} activation quantization ({_bits(act)}, with {_bits(w)} weights)"
    if w.dynamic:
        return "dynamic weight quantization"
    if w.strategy != "group":
        return f"strategy '{w.strategy}' (only 'group', with a group_size)"
    if w.actorder not in (None, "weight", "static"):  # 'weight' only orders the calibration: the same format
        return f"activation ordering actorder '{w.actorder}' (weights in activation order, with g_idx)"
    if fmt != FORMAT:
        return f"format '{fmt}' (only '{FORMAT}')"
    try:
        check_group(w.group_size, w.group_size)
    except ValueError:
        return f"group_size {w.group_size} (a power of two of at least {VALUES_PER_WORD})"
    return None


def _raw_problem(qc: dict) -> str | None:
    """What the engine does not run that compressed-tensors' model refuses to parse or ignores."""
    for name, group in (qc.get("config_groups") or {}).items():
        actorder = (group.get("weights") or {}).get("actorder") if isinstance(group, dict) else None
        if actorder is True or str(actorder).lower() in ("group", "dynamic"):
            return (f"group '{name}': activation ordering actorder {actorder!r} (weights in activation order, "
                    "with g_idx)")
    for key, what in (("sparsity_config", "sparsity"), ("transform_config", "transforms")):
        if qc.get(key):
            return f"{what} ({key})"
    if qc.get("kv_cache_scheme"):
        return "KV-cache quantization (kv_cache_scheme)"
    status = qc.get("quantization_status")
    if status is not None and status != "compressed":
        return f"quantization_status '{status}' (a {FORMAT} checkpoint is 'compressed')"
    return None


def read_quantization(config: dict, where) -> QuantSpec | None:
    """config.json (or a multimodal wrapper's, whose text_config may hold it) -> the QuantSpec of its
    quantization_config, None without one. Anything the engine does not run is a ConfigError of one line
    naming it (fp8 / FP8 block, NVFP4, MXFP4, w8a8 / int8, AWQ, GPTQ, act-order, activation quantization, a
    strategy other than group, a format other than pack-quantized, num_bits other than 4)."""
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"{where}: quantization_config is a {type(qc).__name__}, expected an object")
    if qc.get("quant_method") != QUANT_METHOD:
        raise ConfigError(f"{where}: quantization_config: {_other_method(qc)} is not run here; {RUNS}")
    if problem := _raw_problem(qc):
        raise ConfigError(f"{where}: quantization_config: {problem} is not run here; {RUNS}")
    _require(f"{where}: a compressed-tensors checkpoint")
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    try:
        parsed = QuantizationConfig.model_validate(qc)
    except (ValidationError, ValueError, KeyError) as e:
        first = e.errors()[0] if isinstance(e, ValidationError) else {"loc": (), "msg": str(e)}
        loc = ".".join(str(p) for p in first["loc"] if "[" not in str(p))  # not pydantic's validator steps
        raise ConfigError(f"{where}: quantization_config{'.' + loc if loc else ''}: "
                          f"{first['msg'].splitlines()[0]}") from None
    if not parsed.config_groups:
        raise ConfigError(f"{where}: quantization_config has no config_groups")
    schemes = []
    for name, scheme in parsed.config_groups.items():
        if problem := _scheme_problem(scheme, scheme.format or parsed.format):
            raise ConfigError(f"{where}: quantization_config group '{name}': {problem} is not run here; {RUNS}")
        schemes.append(Int4Scheme(tuple(scheme.targets), bool(scheme.weights.symmetric),
                                  int(scheme.weights.group_size)))
    return QuantSpec(tuple(schemes), tuple(parsed.ignore or ()))


# ----------------------------------------------------------------------------- tensors

def _getter(tensors, where) -> Callable[[str], torch.Tensor]:
    """A Mapping or a get(name) (None or KeyError when absent; its own CheckpointError passes through)."""
    def get(name: str) -> torch.Tensor:
        try:
            t = (tensors[name] if name in tensors else None) if isinstance(tensors, Mapping) else tensors(name)
        except KeyError:
            t = None
        if t is None:
            raise CheckpointError(f"{where}: missing tensor '{name}'")
        return t
    return get


def _check(where, name: str, t: torch.Tensor, shape: tuple[int, ...], dtype_ok: bool, dtype_wanted: str) -> None:
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{where}: tensor '{name}' has shape {tuple(t.shape)}, expected {shape}")
    if not dtype_ok:
        raise CheckpointError(f"{where}: tensor '{name}' is {t.dtype}, expected {dtype_wanted}")


def load_int4(tensors, prefix: str, spec: QuantSpec, where, module: torch.nn.Module | str | None = "Linear"
              ) -> Int4Linear:
    """One INT4 linear `prefix` (e.g. "model.layers.3.mlp.experts.7.gate_proj") from `tensors` (a Mapping of
    stored names, or a get(name)) -> Int4Linear, every tensor's shape checked against `weight_shape`. A missing
    tensor: CheckpointError "<where>: missing tensor '<name>'"."""
    scheme = spec.scheme_for(prefix, module)
    if scheme is None:
        raise CheckpointError(f"{where}: '{prefix}' is not INT4 by the checkpoint's quantization_config")
    get = _getter(tensors, where)
    names = {t: f"{prefix}.{t}" for t in (*WEIGHT_TENSORS, "weight_zero_point")}
    packed, scale, stored_shape = (get(names[t]) for t in WEIGHT_TENSORS)
    zero = None if scheme.symmetric else get(names["weight_zero_point"])
    if stored_shape.numel() != 2 or stored_shape.is_floating_point():
        raise CheckpointError(f"{where}: tensor '{names['weight_shape']}' holds {stored_shape.tolist()}, "
                              "expected the two ints (N, K)")
    N, K = (int(v) for v in stored_shape.tolist())
    G = scheme.group_size
    if K % G:
        raise CheckpointError(f"{where}: '{prefix}' has K={K} columns, not a multiple of its group size {G}")
    _check(where, names["weight_packed"], packed, (N, K // VALUES_PER_WORD), packed.dtype == torch.int32, "int32")
    _check(where, names["weight_scale"], scale, (N, K // G), scale.is_floating_point(), "a float dtype")
    if zero is not None:
        _check(where, names["weight_zero_point"], zero, (-(-N // VALUES_PER_WORD), K // G),
               zero.dtype == torch.int32, "int32")
    return Int4Linear(packed, scale, zero, (N, K))


def _rows(parts: Sequence[Int4Linear]) -> Int4Linear:
    """Linears with the same K stacked along N (gate rows, then up rows)."""
    if len(parts) == 1:
        return parts[0]
    K = parts[0].shape[1]
    if any(p.shape[1] != K for p in parts) or len({p.scale.shape[1] for p in parts}) != 1:
        raise ValueError(f"stack_int4: linears stacked along N need one K and group size, got "
                         f"{[p.shape for p in parts]}")
    if len({p.zero is None for p in parts}) != 1:
        raise ValueError("stack_int4: symmetric and asymmetric linears cannot share a stack")
    zero = None
    if parts[0].zero is not None:
        if any(p.shape[0] % VALUES_PER_WORD for p in parts[:-1]):
            raise ValueError(f"stack_int4: zero points are packed {VALUES_PER_WORD} rows a word, so each stacked "
                             f"linear but the last needs N a multiple of {VALUES_PER_WORD}, got "
                             f"{[p.shape[0] for p in parts]}")
        zero = torch.cat([p.zero for p in parts])
    return Int4Linear(torch.cat([p.packed for p in parts]), torch.cat([p.scale for p in parts]), zero,
                      (sum(p.shape[0] for p in parts), K))


def stack_int4(experts: Sequence[Int4Linear | Sequence[Int4Linear]]) -> Int4Weights:
    """Per expert one linear (down) or several stacked along N (gate then up, as the dense [E, 2I, H]) ->
    Int4Weights [E, N, K] for the fused-MoE kernel (copies; the scales keep their stored dtype)."""
    rows = [_rows([e] if isinstance(e, Int4Linear) else list(e)) for e in experts]
    if not rows:
        raise ValueError("stack_int4: no experts")
    if len({r.shape for r in rows}) != 1 or len({r.scale.dtype for r in rows}) != 1:
        raise ValueError(f"stack_int4: experts differ in shape or scale dtype: "
                         f"{sorted({(r.shape, str(r.scale.dtype)) for r in rows})}")
    N, K = rows[0].shape
    zero = None if rows[0].zero is None else torch.stack([r.zero for r in rows])
    return Int4Weights(torch.stack([r.packed for r in rows]), torch.stack([r.scale for r in rows]), zero,
                       K // rows[0].scale.shape[1])


# ----------------------------------------------------------------------------- writing (fixtures)

def int4_config(targets: Sequence[str], ignore: Sequence[str] = (), group_size: int = 32, symmetric: bool = True):
    """compressed-tensors' QuantizationConfig for one INT4 weight-only group (the W4A16 / W4A16_ASYM scheme at
    `group_size`), pack-quantized, compressed."""
    _require("writing an INT4 checkpoint")
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=list(targets), weights=weights, format=FORMAT)
    return QuantizationConfig(config_groups={"group_0": scheme}, format=FORMAT, quantization_status="compressed",
                              ignore=list(ignore))


def quantize_linear(weight: torch.Tensor, scheme) -> dict[str, torch.Tensor]:
    """weight [N, K] -> its pack-quantized tensors (weight_packed, weight_scale, weight_shape, and
    weight_zero_point when asymmetric), by compressed-tensors: min-max scales and zero points per group
    (calculate_qparams), then its pack-quantized compressor. Scales in the weight's dtype."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    G = scheme.weights.group_size
    check_group(G, weight.shape[-1], "quantize_linear")
    groups = weight.unflatten(-1, (-1, G))                                             # [N, K/G, G]
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    return PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale,
                                                  "weight_zero_point": zero}, scheme)


def quantize_state_dict(state_dict: Mapping[str, torch.Tensor], qconfig) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A dense state dict -> (the same with every targeted linear's `<module>.weight` [N, K] replaced by its
    pack-quantized tensors, the modules quantized). Targets must be names or "re:" patterns: tensor names
    cannot tell a module's class."""
    spec = read_quantization({"quantization_config": qconfig.model_dump(mode="json")}, "quantize_state_dict")
    classes = [t for s in spec.schemes for t in s.targets if _rank(t) == "class"]
    if classes:
        raise ValueError(f"quantize_state_dict: target {classes[0]!r} names a module class, which tensor names "
                         "cannot tell; give module names or 're:' patterns")
    out, done = {}, []
    schemes = dict(zip(spec.schemes, qconfig.config_groups.values()))  # ours -> compressed-tensors' own
    for name, t in state_dict.items():
        module, _, leaf = name.rpartition(".")
        scheme = spec.scheme_for(module, None) if leaf == "weight" and t.dim() == 2 else None
        if scheme is None:
            out[name] = t
            continue
        out.update({f"{module}.{k}": v for k, v in quantize_linear(t, schemes[scheme]).items()})
        done.append(module)
    return out, done


def write_int4_checkpoint(directory, targets: Sequence[str], ignore: Sequence[str] = (), group_size: int = 32,
                          symmetric: bool = True) -> list[str]:
    """Rewrite a saved model directory (model.safetensors, or the shards of model.safetensors.index.json) in
    place with its targeted linears INT4 pack-quantized, and config.json's quantization_config written by
    compressed-tensors (ModelCompressor.update_config) -> the modules quantized. CPU-friendly: one file at a
    time, min-max scales (no calibration data)."""
    from compressed_tensors.compressors import ModelCompressor
    from safetensors.torch import load_file, save_file

    directory = Path(directory)
    qconfig = int4_config(targets, ignore, group_size, symmetric)
    index = directory / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    files = sorted(set(weight_map.values())) if weight_map is not None else ["model.safetensors"]
    done = []
    for fname in files:
        tensors, quantized = quantize_state_dict(load_file(str(directory / fname)), qconfig)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / fname), metadata={"format": "pt"})
        if weight_map is not None:
            for module in quantized:
                weight_map.pop(f"{module}.weight")
            weight_map.update({k: fname for k in tensors})
        done += quantized
    if weight_map is not None:
        data = json.loads(index.read_text())
        data["weight_map"] = dict(sorted(weight_map.items()))
        index.write_text(json.dumps(data, indent=2))
    ModelCompressor(quantization_config=qconfig).update_config(str(directory))
    return done
