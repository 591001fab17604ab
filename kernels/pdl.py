"""Programmatic dependent launch (Hopper and later), for the kernels that take it (`PDL`).

    _pdl_start(PDL)            the first thing every program of such a kernel does
    pdl_applies(pdl, tensor)   whether a launch asked for it takes it (compiled, on a CUDA device)
    launch_options(pdl)        the launch's extra option: {"launch_pdl": True}, or {}

A kernel launched with `launch_pdl` may start while the kernel before it on the stream is still running: its
programs become resident and wait in `griddepcontrol.wait` until that kernel has finished and its writes are
visible, so the launch and the programs' start overlap the previous kernel's tail instead of following it. An AR
step's MoE block and its attention (the kernel, then its merge) are chains of short launches (docs/performance.md,
"Session 23"), where that gap is a fair share of each kernel's time.

The rule that makes it safe: every program waits before it reads anything another kernel wrote, and before it
exits, even a program with nothing to do. Then a kernel completes only after the one before it has, so waiting on
the previous kernel also covers every kernel before that (the sort two launches back, say). After its wait a
program lets the next launch start (`griddepcontrol.launch_dependents`): by then it is resident, so the next
kernel's programs take only room it leaves. Without the launch option both instructions do nothing, so the
kernels compiled with them are right either way; Triton's interpreter runs no inline assembly, so there `PDL`
stays off.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    """Wait for the kernel before (its writes visible), then let the next one launch; nothing unless PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_applies(pdl: bool, tensor) -> bool:
    """Whether a launch asked for PDL takes it: compiled kernels on a CUDA device (not the interpreter)."""
    return bool(pdl) and tensor.device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"


def launch_options(pdl: bool) -> dict:
    """The launch keyword that makes a kernel a programmatic dependent (pdl: pdl_applies' answer)."""
    return {"launch_pdl": True} if pdl else {}
