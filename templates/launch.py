"""Triton kernel launches with a fixed grid, made straight through Triton's compiled launcher.

A kernel launched many times per step with the same shapes (tree attention: once per layer) pays
Triton's per-call argument binding, specialization and cache lookup each time. `Launch` pays it once:
its first call goes through Triton and keeps the compiled kernel, later calls make the launcher call
that Triton's own `JITFunction.run` makes. The caller must key its `Launch` objects on everything
Triton specializes on (see `Launch`). `set_fast_launch(False)` turns the direct path off (benchmarks
compare both); it also turns itself off, for good, on a Triton whose launcher layout it does not know.
"""

from __future__ import annotations

try:
    import triton
except ImportError:  # CPU installs without triton: nothing is launched
    triton = None


class FastLaunch:
    enabled = False
    driver = None
    error = None  # why the direct path was turned off, if it was


FAST = FastLaunch()
_knobs = None
_CompiledKernel = ()
if triton is not None:
    try:  # the direct launch path needs Triton >= 3.4's knobs / CompiledKernel.run layout
        from triton import knobs as _knobs
        from triton.compiler.compiler import CompiledKernel as _CompiledKernel

        FAST.enabled = not _knobs.runtime.interpret
    except ImportError:
        FAST.enabled = False


def set_fast_launch(enabled: bool) -> None:
    """Turn the direct launcher path on or off (benchmarks compare both; off = Triton's own path)."""
    FAST.enabled = bool(enabled) and _knobs is not None and not _knobs.runtime.interpret


class Launch:
    """One kernel launch with a fixed grid and constexprs.

    The first call goes through Triton (compiling if needed) and keeps the compiled kernel; later calls
    make the same launcher call that Triton's JITFunction.run makes, without its per-call binding,
    specialization and cache lookup (launch metadata and hooks are passed exactly as Triton passes them).
    Valid only while the caller's key fixes everything Triton specializes on: dtypes, 16-byte pointer
    alignment, strides, and the integer arguments that are not marked do_not_specialize. The
    interpreter, or another current device than the launch's, takes the ordinary path."""

    __slots__ = ("fn", "grid", "meta", "consts", "device", "compiled")

    def __init__(self, fn, grid, meta: dict, n_args: int, device):
        self.fn, self.grid, self.meta, self.device, self.compiled = fn, grid, meta, device, None
        names = list(fn.arg_names)
        self.consts = tuple(meta[n] for n in names[n_args:])  # constexpr params, in signature order
        if len(names) != n_args + len(self.consts) or any(n not in meta for n in names[n_args:]):
            raise RuntimeError(f"launch arguments do not match {fn.__name__}'s signature")

    def __call__(self, *args):
        ck = self.compiled
        if ck is not None and FAST.enabled:
            drv = FAST.driver
            dev = drv.get_current_device()
            if dev == self.device:
                g, rt = self.grid, _knobs.runtime
                stream = drv.get_current_stream(dev)
                full = (*args, *self.consts)
                try:
                    ck.run(g[0], g[1], g[2], stream, ck.function, ck.packed_metadata,
                           ck.launch_metadata(g, stream, *full), rt.launch_enter_hook, rt.launch_exit_hook, *full)
                    return
                except (TypeError, ValueError, AttributeError) as e:  # a launcher layout this code does not know
                    FAST.enabled, FAST.error = False, repr(e)  # (rejected before launching): Triton's path
        k = self.fn[self.grid](*args, **self.meta)
        if FAST.enabled and self.device is not None and isinstance(k, _CompiledKernel):
            FAST.driver = triton.runtime.driver.active
            self.compiled = k
