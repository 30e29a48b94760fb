"""Tests only: on PYTHONPATH of a server started with DDTREE_TEST_CPU_* set (testing/server.py), every Python
process of that server (API server, engine core, workers, forked or spawned) takes the forced CPU choices
(testing/cpu_choices.py) before vLLM starts; then the next `sitecustomize` on the path runs as it would have
(the suite's serve hooks, tests/serve_hooks)."""

import importlib.util
import os
import sys

if os.environ.get("DDTREE_TEST_CPU_ATTN_ISA") or os.environ.get("DDTREE_TEST_CPU_KIND"):
    from ddtree_compile.testing import cpu_choices

    cpu_choices.apply_from_env()

_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    _path = os.path.join(os.path.abspath(_entry or "."), "sitecustomize.py")
    if os.path.dirname(_path) != _here and os.path.isfile(_path):
        _spec = importlib.util.spec_from_file_location("_next_sitecustomize", _path)
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
