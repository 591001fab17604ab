"""Loading and saving model directories in the formats users already have on disk.

Targets: HF `Qwen3ForCausalLM` / `LlamaForCausalLM` / `Qwen3MoeForCausalLM` directories (MoE experts per
expert, `mlp.experts.{e}.{gate,up,down}_proj.weight`, as transformers saves them, or stacked,
`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]). Drafters: the public DFlash format.
Weights come from `model.safetensors` or shards listed in `model.safetensors.index.json`; the
tokenizer from `tokenizer.json` (+ `tokenizer_config.json`). Nothing is fetched from a hub.
Every error names the directory, file, tensor or field that is wrong.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .attention import check_backend
from .config import (CheckpointError, ConfigError, DrafterConfig, TargetConfig, check_pair,
                     drafter_config_from_hf, read_json, target_config_from_hf, text_model_config)
from .declared_routing import routing_name
from .drafter import Drafter
from .kernels.int4 import VALUES_PER_WORD
from .model import Target
from .moe import narrow_routers
from . import parallel
from .names import DTYPE_NAMES


def torch_dtype(dtype) -> torch.dtype:
    """A dtype name ("bfloat16", "bf16", …) or a torch.dtype -> the torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
    return getattr(torch, DTYPE_NAMES[dtype])


@dataclass
class Pair:
    """A target, its drafter and the tokenizer: everything `generate` needs."""

    target: Target
    drafter: Drafter | None
    tokenizer: object | None  # tokenizers.Tokenizer
    name: str
    target_id: dict
    drafter_id: dict | None
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)
    chat_template: str | None = None
    special_tokens: dict = field(default_factory=dict)
    load_seconds: float = 0.0

    @property
    def attention(self) -> str:
        return self.target.attention

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this pair has no tokenizer: pass the prompt as a list of token ids")
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def describe(self) -> dict:
        out = {"name": self.name, "target": self.target_id, "drafter": self.drafter_id,
               "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
               "attention": self.attention}
        if self.target.cfg.is_moe:  # which experts tokens go to: every MoE figure rests on it
            out["routing"] = routing_name(self.target.routing)
        return out


# ----------------------------------------------------------------------------- tensors

def _tensor_files(directory: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it."""
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: missing field 'weight_map'")
        files = {name: directory / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"{index}: lists shard {f.name}, which is not in {directory}")
        return files
    if single.is_file():
        try:
            with safe_open(str(single), "pt") as f:
                return {name: single for name in f.keys()}
        except Exception as e:  # noqa: BLE001 - the reader's own error type; name the file instead
            raise CheckpointError(f"{single}: not a readable safetensors file ({e})") from None
    raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")


class _TensorReader:
    """Reads stored tensors by name, checking their shapes. With shard=(rank, tp) it reads only rank's share
    of each tensor tensor parallelism splits (parallel.stored_split), through safetensors' slices."""

    def __init__(self, directory: Path, strip_prefix: str = "", shard: tuple[int, int] = (0, 1)):
        self.directory = directory
        self.files = _tensor_files(directory)
        self.stored_names = {name: name for name in self.files}  # our name -> the name in its file
        if strip_prefix:
            self.stored_names = {(k[len(strip_prefix):] if k.startswith(strip_prefix) else k): k
                                 for k in self.files}
            self.files = {name: self.files[k] for name, k in self.stored_names.items()}
        self.rank, self.tp = shard
        self._handles: dict[Path, object] = {}

    def has(self, name: str) -> bool:
        return name in self.files

    def release(self) -> None:
        """Drop the open files: the pages a file's mapping has touched count as this process's memory until
        the mapping goes, so a loader releases them as it goes rather than holding the whole checkpoint."""
        self._handles.clear()

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), "pt")
        return self._handles[path]

    def get_whole(self, name: str) -> torch.Tensor | None:
        """The stored tensor `name` whole, any shape (None when absent): for small tensors read to be checked."""
        if name not in self.files:
            return None
        with _named_if_unreadable(self.files[name]):
            return self._handle(self.files[name]).get_tensor(self.stored_names[name])

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor `name` as this reader's process holds it, of `shape` (its share when sharded). The
        result may be a view of the file's mapping: copy it before release()."""
        if name not in self.files:
            raise CheckpointError(f"{self.directory}: missing tensor '{name}'")
        path, stored = self.files[name], self.stored_names[name]
        split = parallel.stored_split(name) if self.tp > 1 else None
        expected = parallel.full_shape(shape, split, self.tp)
        with _named_if_unreadable(path):
            handle = self._handle(path)
            sliced = handle.get_slice(stored)  # reads nothing yet
            found = tuple(sliced.get_shape())
        if found != expected:
            raise CheckpointError(f"{path}: tensor '{stored}' has shape {found}, expected {expected}")
        with _named_if_unreadable(path):
            if split is None:
                return handle.get_tensor(stored)
            return parallel.read_share(sliced, split, self.rank, self.tp)


@contextmanager
def _named_if_unreadable(path: Path):
    try:
        yield
    except Exception as e:  # noqa: BLE001 - a truncated or garbled file: name it
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def _fill(module: torch.nn.Module, reader: _TensorReader, mapping: dict[str, list[str]]) -> None:
    """mapping: our parameter name -> the stored names concatenated (dim 0) into it. A stacked expert
    parameter [E, R, C] is filled from per-expert [r, C] tensors as its [E·R, C] view. The files are
    released after each parameter, so a load holds little more than the model it builds."""
    own = {**dict(module.named_parameters()), **dict(module.named_buffers())}  # INT4 experts are buffers
    with torch.no_grad():
        for ours, stored in mapping.items():
            _fill_parameter(module, reader, ours, own[ours], stored)
            reader.release()


def _fill_parameter(module, reader: _TensorReader, ours: str, param: torch.Tensor, stored: list[str]) -> None:
    """Copy each stored tensor into its rows of `param` as it is read (no concatenated copy in between)."""
    flat = param.view(-1, param.shape[-1]) if param.dim() == 3 and len(stored) > 1 else param
    start = 0
    for name in stored:
        rows = _rows_of(name, module, ours, flat, len(stored))
        flat[start:start + rows].copy_(reader.get(name, (rows, *flat.shape[1:])))
        start += rows


def _rows_of(name: str, module, ours: str, param: torch.Tensor, n_parts: int) -> int:
    """Rows each stored tensor contributes to a fused parameter."""
    if n_parts == 1:
        return param.shape[0]
    cfg = module.cfg
    if ".shared_experts." in name:  # DeepSeek's shared experts: gate then up, each n_shared · I rows
        return cfg.moe_intermediate_size * cfg.n_shared_experts
    if ".experts." in name:  # per-expert tensors: gate/up [I, H] rows of gate_up, down [H, I] rows of down
        rows = cfg.hidden_size if ".down_proj." in name else cfg.moe_intermediate_size
        return -(-rows // VALUES_PER_WORD) if name.endswith("weight_zero_point") else rows  # INT4 zero points: 8 a word
    if f".{MLA_FUSED_DOWN[0]}." in ours:  # q_a_proj's rows, then kv_a_proj_with_mqa's
        return cfg.mla.q_lora_rank if ".q_a_proj." in name else cfg.mla.cache_width
    if ".wqkv." in ours:
        kind = name.split(".")[-2]  # q_proj | k_proj | v_proj
        heads = cfg.num_attention_heads if kind == "q_proj" else cfg.num_key_value_heads
        return heads * cfg.head_dim
    return cfg.intermediate_size  # gate_up: gate then up


def _layer_mapping(prefix: str, i: int, qk_norm: bool, bias: bool) -> dict[str, list[str]]:
    src = f"{prefix}layers.{i}"
    ours = f"layers.{i}"
    m = {
        f"{ours}.input_layernorm.weight": [f"{src}.input_layernorm.weight"],
        f"{ours}.post_attention_layernorm.weight": [f"{src}.post_attention_layernorm.weight"],
        f"{ours}.qkv.wqkv.weight": [f"{src}.self_attn.{p}_proj.weight" for p in "qkv"],
        f"{ours}.o_proj.weight": [f"{src}.self_attn.o_proj.weight"],
        f"{ours}.mlp.gate_up.weight": [f"{src}.mlp.gate_proj.weight", f"{src}.mlp.up_proj.weight"],
        f"{ours}.mlp.down.weight": [f"{src}.mlp.down_proj.weight"],
    }
    if bias:
        m[f"{ours}.qkv.wqkv.bias"] = [f"{src}.self_attn.{p}_proj.bias" for p in "qkv"]
    if qk_norm:
        m[f"{ours}.qkv.q_norm.weight"] = [f"{src}.self_attn.q_norm.weight"]
        m[f"{ours}.qkv.k_norm.weight"] = [f"{src}.self_attn.k_norm.weight"]
    return m


MLA_PROJECTIONS = ("kv_a_layernorm", "kv_b_proj", "o_proj")
# by q_lora_rank is None: without a q LoRA, q_proj and kv_a_proj_with_mqa; with one, its norm and up projection
# (its down projection is fused with kv_a_proj_with_mqa: MLA_FUSED_DOWN)
MLA_Q_PROJECTIONS = {False: ("q_a_layernorm", "q_b_proj"), True: ("q_proj", "kv_a_proj_with_mqa")}
MLA_FUSED_DOWN = ("qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa"))  # ours, then the stored ones in its rows


def _mla_layer_mapping(i: int, cfg: TargetConfig) -> dict[str, list[str]]:
    """A DeepSeek-V3 layer's norms, MLA projections (stored under the reference's names) and dense MLP."""
    src, ours = f"model.layers.{i}", f"layers.{i}"
    m = {f"{ours}.{n}.weight": [f"{src}.{n}.weight"] for n in ("input_layernorm", "post_attention_layernorm")}
    for proj in MLA_Q_PROJECTIONS[cfg.mla.q_lora_rank is None] + MLA_PROJECTIONS:
        m[f"{ours}.self_attn.{proj}.weight"] = [f"{src}.self_attn.{proj}.weight"]
    if cfg.mla.q_lora_rank is not None:
        fused, parts = MLA_FUSED_DOWN
        m[f"{ours}.self_attn.{fused}.weight"] = [f"{src}.self_attn.{p}.weight" for p in parts]
    m[f"{ours}.mlp.gate_up.weight"] = [f"{src}.mlp.gate_proj.weight", f"{src}.mlp.up_proj.weight"]
    m[f"{ours}.mlp.down.weight"] = [f"{src}.mlp.down_proj.weight"]
    return m


def _moe_mapping(i: int, cfg: TargetConfig, stacked: bool) -> dict[str, list[str]]:
    """Layer i's sparse block: the router, and the experts per expert (gate, up of each expert in turn) or
    stacked as transformers holds them in memory; DeepSeek's correction bias and shared experts."""
    src, ours = f"model.layers.{i}.mlp", f"layers.{i}.mlp"
    m = {f"{ours}.router.weight": [f"{src}.gate.weight"]}
    if cfg.arch == "deepseek_v3":
        m[f"{ours}.router.e_score_correction_bias"] = [f"{src}.gate.e_score_correction_bias"]
        if cfg.n_shared_experts:
            m[f"{ours}.shared.gate_up.weight"] = [f"{src}.shared_experts.{p}_proj.weight" for p in ("gate", "up")]
            m[f"{ours}.shared.down.weight"] = [f"{src}.shared_experts.down_proj.weight"]
    if cfg.expert_int4_group:  # INT4 experts (quant.py): each stored tensor of every expert into its stack
        experts = range(cfg.num_experts)
        for stack, projections in (("gate_up", ("gate", "up")), ("down", ("down",))):
            for ours_name, stored in (("packed", "weight_packed"), ("scale", "weight_scale"),
                                      ("zero", "weight_zero_point")):
                if ours_name == "zero" and not cfg.expert_int4_asymmetric:
                    continue
                m[f"{ours}.{stack}.{ours_name}"] = [f"{src}.experts.{e}.{p}_proj.{stored}" for e in experts
                                                    for p in projections]
    elif stacked:
        m[f"{ours}.gate_up"] = [f"{src}.experts.gate_up_proj"]
        m[f"{ours}.down"] = [f"{src}.experts.down_proj"]
    else:
        experts = range(cfg.num_experts)
        m[f"{ours}.gate_up"] = [f"{src}.experts.{e}.{p}_proj.weight" for e in experts for p in ("gate", "up")]
        m[f"{ours}.down"] = [f"{src}.experts.{e}.down_proj.weight" for e in experts]
    return m


def target_mapping(cfg: TargetConfig, reader: _TensorReader | None = None) -> dict[str, list[str]]:
    """Our parameter names -> the stored ones. With a reader, an MoE layer's experts are read stacked when
    the checkpoint holds them so; without one (saving) they are written per expert."""
    m = {"embed_tokens.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    for i in range(cfg.num_hidden_layers):
        m.update(_layer_mapping("model.", i, cfg.qk_norm, cfg.attention_bias) if cfg.mla is None
                 else _mla_layer_mapping(i, cfg))
        if cfg.is_moe_layer(i):
            for name in ("gate_up.weight", "down.weight"):
                del m[f"layers.{i}.mlp.{name}"]
            stacked = reader is not None and reader.has(f"model.layers.{i}.mlp.experts.gate_up_proj")
            m.update(_moe_mapping(i, cfg, stacked))
    if not cfg.tie_word_embeddings:
        m["lm_head.weight"] = ["lm_head.weight"]
    return m


def drafter_mapping(cfg: DrafterConfig, reader: _TensorReader | None = None) -> dict[str, list[str]]:
    m = {"fc.weight": ["fc.weight"], "hidden_norm.weight": ["hidden_norm.weight"], "norm.weight": ["norm.weight"]}
    for i in range(cfg.num_hidden_layers):
        m.update(_layer_mapping("", i, True, False))
    return m


def _identity(directory: Path, kind: str) -> dict:
    config_bytes = (directory / "config.json").read_bytes()
    return {"path": str(directory), "kind": kind,
            "config_sha256": hashlib.sha256(config_bytes).hexdigest()[:16]}


# ----------------------------------------------------------------------------- loading

def _load(kind, directory, device, dtype, read_config, model_cls, mapping, shard=(0, 1)):
    """Build the model on the meta device at the sizes this process holds (shard=(rank, tp): its share of a
    tensor-parallel target), allocate it on `device` in `dtype`, and fill it tensor by tensor from safetensors."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{kind} directory {directory} does not exist")
    raw = read_json(directory / "config.json")
    cfg = read_config(raw, directory / "config.json")
    wrapped = kind == "target" and text_model_config(raw, directory)[1]
    rank, tp = shard
    reader = _TensorReader(directory, shard=shard, strip_prefix=TEXT_MODEL_PREFIX if wrapped else "")
    int4_checked = set()
    if kind == "target":
        cfg, int4_checked = _int4_experts(cfg, raw, reader, directory)
    local_cfg = parallel.local_config(cfg, tp) if tp > 1 else cfg
    with torch.device("meta"):
        model = model_cls(local_cfg).to(dtype)
    model = model.to_empty(device=device)
    if kind == "drafter" and not reader.has("fc.weight") and reader.has("model.fc.weight"):
        reader = _TensorReader(directory, strip_prefix="model.")  # some exports prefix drafter tensors
    wanted = mapping(cfg, reader)
    _check_all_used(reader, wanted, cfg, skipped=_skipped_tensors(reader, raw, cfg, wrapped) | int4_checked)
    _fill(model, reader, wanted)
    narrow_routers(model)  # a router stored in bf16 stays bf16 (exact), halving what a step reads of it
    model.rotary = type(model.rotary)(cfg.rope_dim, cfg.rope, model.rotary.max_positions)  # not in checkpoints
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


# Stored tensors a model may carry that hold nothing this engine reads: RoPE tables (recomputed from the
# config), and an lm_head saved beside tied embeddings (the tie makes it the embedding).
_IGNORABLE = (".rotary_emb.inv_freq",)


TEXT_MODEL_PREFIX = "language_model."  # where a multimodal wrapper keeps its text model's tensors


def _int4_experts(cfg, raw: dict, reader: _TensorReader, directory: Path):
    """A compressed-tensors INT4 checkpoint (quant.py) -> cfg with its experts' group size, and the stored
    `weight_shape` tensors, each checked against its linear's size. The engine runs INT4 routed experts only:
    any other INT4 linear is refused by name, as is an MoE layer whose experts are not all INT4."""
    packed = sorted(n[: -len(".weight_packed")] for n in reader.files if n.endswith(".weight_packed"))
    if not packed and not (raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")):
        return cfg, set()
    from .quant import load_int4, read_quantization

    where = directory / "config.json"
    spec = read_quantization(raw, where)
    if spec is None or not packed:
        return cfg, set()
    other = [n for n in packed if ".mlp.experts." not in n or not getattr(cfg, "num_experts", 0)]
    if other:
        raise ConfigError(f"{where}: INT4 '{other[0]}' is not run here: the engine runs INT4 routed experts (attention, "
                          f"shared experts, dense MLPs and lm_head stay in 16 bits)"
                          + (f"; {len(other) - 1} more" if len(other) > 1 else ""))
    layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    expected = {f"model.layers.{i}.mlp.experts.{e}.{p}_proj" for i in layers for e in range(cfg.num_experts)
                for p in ("gate", "up", "down")}
    if set(packed) != expected:
        missing = sorted(expected - set(packed))
        raise CheckpointError(f"{directory}: the experts are INT4 in part only: '{missing[0]}.weight_packed' is "
                              f"missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    stored_prefix = {n: reader.stored_names[n + ".weight_packed"][: -len(".weight_packed")] for n in packed}
    schemes = {spec.scheme_for(stored_prefix[n]) for n in packed}
    if None in schemes or len({(s.group_size, s.symmetric) for s in schemes}) != 1:
        raise ConfigError(f"{where}: quantization_config gives the experts' INT4 tensors differing schemes (or none); "
                          "the engine runs one group size and symmetry for all experts")
    scheme = schemes.pop()
    ours = {stored: name for name, stored in reader.stored_names.items()}
    load_int4(lambda n: reader.get_whole(ours.get(n, n)), stored_prefix[packed[0]], spec, directory)  # one in full
    for name in packed:  # every linear's weight_shape (two ints) against the config; the rest's shapes are read later
        want = (cfg.hidden_size, cfg.moe_intermediate_size) if name.endswith("down_proj") else (
            cfg.moe_intermediate_size, cfg.hidden_size)
        stored = reader.get_whole(f"{name}.weight_shape")
        if stored is None or stored.is_floating_point() or tuple(stored.tolist()) != want:
            shown = "missing" if stored is None else f"holds {stored.tolist()}"
            raise CheckpointError(f"{directory}: tensor '{reader.stored_names.get(name + '.weight_shape', name)}' "
                                  f"is {shown}, expected {list(want)}")
    reader.release()
    cfg = dataclasses.replace(cfg, expert_int4_group=scheme.group_size, expert_int4_asymmetric=not scheme.symmetric)
    return cfg, {f"{n}.weight_shape" for n in packed}


def _skipped_tensors(reader: _TensorReader, raw: dict, cfg, wrapped: bool) -> set[str]:
    """Stored tensors of parts the engine does not run, each kind named in one note: a multimodal wrapper's
    vision tower and projector, and DeepSeek's multi-token-prediction layers (numbered past the last layer)."""
    skipped, notes = set(), []
    if wrapped:
        outside = {n for n, stored in reader.stored_names.items() if not stored.startswith(TEXT_MODEL_PREFIX)}
        skipped |= outside
        if outside:
            notes.append(f"{len(outside)} tensors outside the text model (vision tower, projector)")
    extra = (raw.get("text_config") if wrapped else raw) or {}
    mtp = int(extra.get("num_nextn_predict_layers") or 0) if getattr(cfg, "arch", "") == "deepseek_v3" else 0
    layers = [f"model.layers.{cfg.num_hidden_layers + j}." for j in range(mtp)]
    past = {n for n in reader.files if n.startswith(tuple(layers))} if layers else set()
    if past:
        skipped |= past
        notes.append(f"{len(past)} tensors of the multi-token-prediction layer(s), which decoding does not use")
    if notes:
        print(f"note: {reader.directory}: skipped " + "; ".join(notes), file=sys.stderr)
    return skipped


def _check_all_used(reader: _TensorReader, mapping: dict[str, list[str]], cfg, skipped: set[str] = frozenset()) -> None:
    """Every stored tensor must be read: one left over means the config describes another model than the
    weights (too few layers, the wrong architecture), which would load and silently compute something else."""
    used = {name for stored in mapping.values() for name in stored} | set(skipped)
    tied_head = {"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", False) else set()
    unused = sorted(n for n in reader.files if n not in used and n not in tied_head
                    and not n.endswith(_IGNORABLE))
    if unused:
        shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
        raise CheckpointError(
            f"{reader.directory}: {len(unused)} stored tensor(s) that config.json does not describe ({shown}); "
            f"check its architectures and num_hidden_layers ({getattr(cfg, 'arch', '?')}, "
            f"{getattr(cfg, 'num_hidden_layers', '?')} layers)")


def load_target(directory, device="cpu", dtype=torch.float32, tp: int = 1, rank: int = 0) -> Target:
    """The target in `directory`; with tp > 1, rank's share of it, read from the files without the rest
    (parallel.py), its blocks summing their outputs across the tp processes."""
    dtype = torch_dtype(dtype)
    target = _load("target", directory, device, dtype, target_config_from_hf, Target, target_mapping, (rank, tp))
    return parallel.connect(target, tp, rank) if tp > 1 else target


def load_drafter(directory, device="cpu", dtype=torch.float32) -> Drafter:
    return _load("drafter", directory, device, dtype, drafter_config_from_hf, Drafter, drafter_mapping)


def load_tokenizer(directory: Path):
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None, {}
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception for a corrupt file
        raise CheckpointError(f"{path}: not a readable tokenizer file ({e})") from None
    tcfg_path = directory / "tokenizer_config.json"
    tcfg = read_json(tcfg_path) if tcfg_path.is_file() else {}
    template_file = directory / "chat_template.jinja"  # where newer transformers save the template
    if not tcfg.get("chat_template") and template_file.is_file():
        tcfg["chat_template"] = template_file.read_text()
    return tok, tcfg


def _token_text(value):
    return value.get("content") if isinstance(value, dict) else value


def load_pair_dirs(target, drafter=None, *, name: str | None = None, device="cpu", dtype="float32",
                   attention: str = "sdpa", compile: bool = False, tp: int = 1, routing="router") -> Pair:
    """A target directory and (optionally) its DFlash drafter's directory -> a Pair (`dl.load_pair` also
    takes names, ddtree_lab/pairs). compile=True fuses the per-layer elementwise work with torch.compile.
    tp=N: this process's share of an N-way tensor-parallel target (parallel.py; on CUDA, its rank's GPU)."""
    start = time.perf_counter()
    dtype = torch_dtype(dtype)
    check_backend(attention)
    device = torch.device(device)
    target_dir = Path(target)
    rank = 0
    if tp != 1:
        rank, rank_device = parallel.init(tp)
        device = rank_device if device.type == "cuda" and rank_device is not None else device
    tmodel = load_target(target_dir, device, dtype, tp=tp, rank=rank)
    tmodel.set_attention(attention)
    tmodel.set_routing(routing)
    if compile:
        tmodel.compile_layers()
    dmodel = None
    if drafter is not None:
        drafter_dir = Path(drafter)
        dmodel = load_drafter(drafter_dir, device, dtype)
        check_pair(tmodel.cfg, dmodel.cfg, where=f"drafter {drafter_dir}")
        dmodel.set_attention(attention)
        if compile:
            dmodel.compile_layers()
    tok, tcfg = load_tokenizer(target_dir)
    if tok is None and drafter is not None:
        tok, tcfg = load_tokenizer(Path(drafter))
    eos = list(tmodel.cfg.eos_token_id)
    eos_text = _token_text(tcfg.get("eos_token"))
    if tok is not None and eos_text and tok.token_to_id(eos_text) is not None:
        eos_id = tok.token_to_id(eos_text)
        eos = eos if eos_id in eos else eos + [eos_id]
    return Pair(
        target=tmodel, drafter=dmodel, tokenizer=tok,
        name=name or target_dir.name,
        target_id=_identity(target_dir, tmodel.cfg.arch),
        drafter_id=_identity(Path(drafter), "dflash") if drafter is not None else None,
        device=device, dtype=dtype, eos_token_ids=eos,
        chat_template=tcfg.get("chat_template"),
        special_tokens={k: _token_text(tcfg.get(k)) for k in ("bos_token", "eos_token", "pad_token")
                        if tcfg.get(k)},
        load_seconds=time.perf_counter() - start,
    )


# ----------------------------------------------------------------------------- saving

def _hf_state(module, mapping: dict[str, list[str]], dtype) -> dict[str, torch.Tensor]:
    own = dict(module.named_parameters())
    out = {}
    for ours, stored in mapping.items():
        param = own[ours].detach().to("cpu", dtype)
        if param.dim() == 3 and len(stored) > 1:  # stacked experts, written one expert tensor at a time
            param = param.reshape(-1, param.shape[-1])
        sizes = [_rows_of(n, module, ours, param, len(stored)) for n in stored]
        for name, part in zip(stored, param.split(sizes, 0)):
            out[name] = part.contiguous()
    return out


def _save(model, mapping, directory, dtype) -> Path:
    """Weights under their HF / DFlash names in model.safetensors, and the model's config.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(_hf_state(model, mapping(model.cfg), dtype), str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    hf = model.cfg.to_hf()
    hf["torch_dtype"] = str(dtype).replace("torch.", "")
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return directory


def save_target(target: Target, directory, dtype=torch.float16, tokenizer_dir=None) -> Path:
    directory = _save(target, target_mapping, directory, dtype)
    if tokenizer_dir is not None:
        for fname in ("tokenizer.json", "tokenizer_config.json"):
            src = Path(tokenizer_dir) / fname
            if src.is_file():
                (directory / fname).write_bytes(src.read_bytes())
    return directory


def save_drafter(drafter: Drafter, directory, dtype=torch.float16) -> Path:
    return _save(drafter, drafter_mapping, directory, dtype)


__all__ = ["Pair", "load_pair_dirs", "torch_dtype", "load_target", "load_drafter", "save_target", "save_drafter",
           "CheckpointError", "ConfigError"]
