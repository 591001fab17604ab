"""What every training stage uses: logging, the device, autocast, the LR schedule, AdamW, weight files."""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn as nn


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def lr_at(step: int, total: int, warmup: int, peak: float, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def init_weights(module: nn.Module, n_layers: int) -> None:
    """GPT-2 style: N(0, 0.02), residual output projections (stacked experts' `mlp.down` too) scaled by
    1/sqrt(2·layers)."""
    for name, p in module.named_parameters():
        if p.dim() < 2:
            continue  # norm weights stay 1 (and a router's correction bias 0)
        std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("o_proj.weight", "down.weight", "mlp.down")) else 0.02
        nn.init.normal_(p, 0.0, std)


def optimizer(module: nn.Module, lr: float, wd: float, device: torch.device):
    decay = [p for p in module.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in module.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": other, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def save_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def save_tensors(sd: dict, path: Path) -> None:
    """A state dict as safetensors, written to a temporary file first (a killed run leaves no half file)."""
    from safetensors.torch import save_file
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp))
    tmp.replace(path)


def save_weights(module: nn.Module, path: Path, dtype=torch.float32) -> None:
    save_tensors({k: v.detach().to("cpu", dtype) for k, v in module.state_dict().items()}, path)


def load_weights(module: nn.Module, path: Path) -> nn.Module:
    from safetensors.torch import load_file
    sd = load_file(str(path))
    module.load_state_dict({k: v.float() for k, v in sd.items()})
    return module


def frozen(target: nn.Module, dtype: torch.dtype, device) -> nn.Module:
    """The target with its weights rounded to `dtype` (what the engine will run), frozen, in eval mode."""
    with torch.no_grad():
        for p in target.parameters():
            p.copy_(p.to(dtype).float())
    target.requires_grad_(False)
    return target.to(device).eval()
