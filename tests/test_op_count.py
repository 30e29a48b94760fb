"""testing/op_count.py's owners: by the module a frame runs in, wherever its file is installed (on the
GPU machine the project is installed under /opt/torch/.venv/.../site-packages, a path holding "/torch/",
where a path test took every DDTree op for vLLM's)."""

from __future__ import annotations

import torch

from ddtree_compile.testing import op_count

SITE = "/opt/torch/.venv/lib/python3.12/site-packages"


def _caller(module: str, path: str):
    """A function whose frame runs in `module`, compiled from `path`: two torch ops, one of them
    through a torch Python function (its own frames are skipped)."""
    code = compile("def f(x):\n    y = x + 1\n    return torch.nn.functional.relu(y)\n", path, "exec")
    scope = {"__name__": module, "torch": torch}
    exec(code, scope)
    return scope["f"]


def test_owner_is_the_module_not_the_path():
    callers = {"ddtree": _caller("ddtree_compile.integration.round.fake", f"{SITE}/ddtree_compile/fake.py"),
               "vllm": _caller("vllm.v1.worker.gpu.fake", f"{SITE}/vllm/v1/fake.py"),
               "testing": _caller("ddtree_compile.testing.fake", f"{SITE}/ddtree_compile/testing/fake.py"),
               "torch-named": _caller("torchvision_like", "/srv/torch/fake.py")}
    counts, x = {}, torch.ones(3)
    for name, f in callers.items():
        counter = op_count.OpCount()
        with counter:
            f(x)
        counts[name] = {owner: sum(counter.select(owner=owner).values()) for owner in ("ddtree", "vllm", "other")
                        if counter.select(owner=owner)}
    assert counts == {"ddtree": {"ddtree": 2}, "vllm": {"vllm": 2}, "testing": {"other": 2},
                      "torch-named": {"other": 2}}, counts


def test_owner_names():
    assert [op_count._owner(m) for m in ("ddtree_compile", "ddtree_compile.core.walk", "ddtree_compile.testing",
                                         "ddtree_compile_x", "vllm", "vllm.config", "vllmx", "torch", "")] == \
        ["ddtree", "ddtree", "other", "other", "vllm", "vllm", "other", "other", "other"]


def test_a_device_counts_only_its_own_ops():
    """device="meta" (CPU's stand-in for "cuda"): ops on CPU tensors are left out, factories of the
    device counted (no tensor among their inputs: their output's device)."""
    f = _caller("ddtree_compile.integration.fake", f"{SITE}/ddtree_compile/fake.py")
    counter = op_count.OpCount(device="meta")
    with counter:
        f(torch.ones(3))  # CPU: none
        f(torch.ones(3, device="meta"))  # the factory (this module: "other") and add, relu (DDTree's)
    assert {o: sum(counter.select(owner=o).values()) for o in ("ddtree", "other")} == {"ddtree": 2, "other": 1}, \
        counter.ops
