"""Which implementation a core step runs: the torch reference or its Triton template (templates/)."""

from __future__ import annotations

import importlib

import torch

IMPLS = ("auto", "torch", "triton")


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def use_triton(x: torch.Tensor, impl: str, template: str, shape: tuple) -> bool:
    """torch on request or off CUDA ("auto"); "triton" insists (and errors if the template can't)."""
    if impl == "torch" or (impl == "auto" and x.device.type != "cuda"):
        return False
    mod = importlib.import_module(f"ddtree_compile.templates.{template}")
    if mod.supports(*shape):
        return True
    if impl == "triton":
        raise ValueError(f"impl='triton': templates/{template}.py does not support shape {shape} "
                         "(or triton is missing); use impl='auto' or 'torch'")
    return False
