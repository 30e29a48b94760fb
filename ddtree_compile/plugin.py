"""vLLM general plugin: makes the DDTree switch available in every vLLM process.

pyproject entry point (group `vllm.general_plugins`):  ddtree = "ddtree_compile.plugin:register"

vLLM runs `register()` once per process (front end, engine core, workers) before the runner
classes are used. It only installs the version-checked runner hook (vllm_patch.py), which does
nothing unless an engine's `additional_config` holds a "ddtree" entry. On a vLLM version the hooks
do not know, nothing is patched: an engine with DDTree switched on then runs as flat DFlash, and
the reason is logged once per process and counted (metrics.PROCESS_STARTUP_FALLBACKS).
"""

from __future__ import annotations


from .metrics import logger  # the package logger (visible without any logging setup)

_DONE = False


def register() -> None:
    global _DONE
    if _DONE:
        return
    _DONE = True
    from . import vllm_patch
    from .metrics import PROCESS_STARTUP_FALLBACKS

    try:
        vllm_patch.install()
    except vllm_patch.UnsupportedVLLM as e:
        PROCESS_STARTUP_FALLBACKS[str(e)] += 1
        logger.warning("ddtree_compile: %s; engines with DDTree switched on (additional_config['ddtree']) "
                       "run as flat DFlash.", e)
