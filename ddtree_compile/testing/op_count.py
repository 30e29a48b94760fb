"""Torch operations of an engine's steps, by region, owner and op: what each party dispatches, the same
way on CPU and on CUDA (a TorchDispatchMode around Model Runner V2's `execute_model` and
`sample_tokens`; in-process engines only).

- owner: the innermost frame outside torch, by its module's name: "ddtree" (the product; not
  ddtree_compile.testing), "vllm", or "other"; a caller may name vLLM lines of its own
  ("vllm-dynamic": `dynamic`).
- region: "step", or the label of the method running (`regions`): e.g. "drafter" inside the
  speculator's `_generate_draft`, which V2 captures as the drafter's CUDA graph.
- On CUDA an op dispatched here runs eagerly: one kernel launch or copy, except views (`views`:
  ops that only make a view, which launch nothing). A CUDA graph's replay dispatches nothing.
"""

from __future__ import annotations

import collections
import linecache
import sys

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class OpCount(TorchDispatchMode):
    def __init__(self, dynamic: tuple[str, str] | None = None, device: str | None = None):
        """dynamic: (a file's path suffix, a text of the line) whose ops count as owner "vllm-dynamic".
        device: count only ops with a tensor of that device type among their inputs or outputs (on a GPU
        "cuda": the host's own tensor work, which launches nothing, left out); None: every op."""
        super().__init__()
        self.dynamic, self.device = dynamic, device
        self.region, self.ops, self.views = "step", collections.Counter(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.device is not None and not any(isinstance(t, torch.Tensor) and t.device.type == self.device
                                               for t in pytree.tree_leaves((args, kwargs, out))):
            return out
        f = sys._getframe(1)
        while f is not None and (_in(_module(f), "torch") or f.f_code.co_filename == "<string>"):
            f = f.f_back
        path = f.f_code.co_filename if f is not None else "?"
        owner = _owner(_module(f) if f is not None else "")
        if (owner == "vllm" and self.dynamic and path.endswith(self.dynamic[0])
                and self.dynamic[1] in linecache.getline(path, f.f_lineno)):
            owner = "vllm-dynamic"
        name = func.overloadpacket.__name__
        if func.is_view:
            self.views.add(name)
        self.ops[f"{self.region}|{owner}|{name}"] += 1
        return out

    def select(self, region: str | None = None, owner: str | None = None, views: bool = True) -> collections.Counter:
        """The counts of one region and owner (None: any), views left out where `views` is False."""
        out = collections.Counter()
        for key, n in self.ops.items():
            g, o, op = key.split("|")
            if (region is None or g == region) and (owner is None or o == owner) and (views or op not in self.views):
                out[key] = n
        return out


def regions(counter: OpCount, methods):
    """Each (class or object, method name, label) of `methods` runs as region `label`. Returns a
    function that puts the methods back."""
    undo = []
    for owner, name, label in methods:
        original = getattr(owner, name)
        undo.append(_restorer(owner, name))

        def wrapped(*a, _original=original, _label=label, **k):
            prev, counter.region = counter.region, _label
            try:
                return _original(*a, **k)
            finally:
                counter.region = prev

        setattr(owner, name, wrapped)
    return lambda: [u() for u in reversed(undo)]


def around_steps(runner, counter: OpCount):
    """Count from now on inside the runner's `execute_model` and `sample_tokens` (V2's engine step).
    Returns a function that stops it."""
    undo = []
    for name in ("execute_model", "sample_tokens"):
        step = getattr(runner, name)
        undo.append(_restorer(runner, name))

        def counted(*a, _step=step, **k):
            with counter:
                return _step(*a, **k)

        setattr(runner, name, counted)
    return lambda: [u() for u in reversed(undo)]


def _module(frame) -> str:
    return frame.f_globals.get("__name__") or ""


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _owner(module: str) -> str:
    """Whose code a frame is, by its module's name, not its file's path: a package installed under a
    path holding "/torch/" (a GPU machine's /opt/torch/.venv/.../site-packages) is still itself."""
    if _in(module, "ddtree_compile") and not _in(module, "ddtree_compile.testing"):
        return "ddtree"
    return "vllm" if _in(module, "vllm") else "other"


def _restorer(owner, name: str):
    """Puts `owner.name` back as it is now: its own attribute, or none (then what it inherits)."""
    if name in owner.__dict__:
        before = owner.__dict__[name]
        return lambda: setattr(owner, name, before)
    return lambda: delattr(owner, name) if name in owner.__dict__ else None
