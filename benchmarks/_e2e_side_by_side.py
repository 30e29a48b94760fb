"""bench_e2e_gpu --side-by-side: every speculative mode's engine up at once, each in a process of its
own, their runs interleaved within each cell."""

from __future__ import annotations

import argparse
import os
import time

import _e2e_cells as cells
import _phase_timers
import _step_clock
from _e2e_engine import ddtree_attached, force_chain, install_oracle, loop_info, loop_of, start_engine, use_loop


def side_by_side(modes, profiles, setup, result, save) -> None:
    """--side-by-side: every speculative mode's engine is up at once, each in its own process
    (ModeWorker), the GPU's memory split evenly between them, and in each (profile, concurrency)
    cell their timed runs alternate, the order rotated per repeat. A drift of the host's speed then
    hits every mode alike: on the H100 flat DFlash's three identical c=1 cells,
    measured minutes apart in one engine, took 13.9, 17.4 and 14.8 ms per round, a spread larger
    than the gains being measured."""
    import multiprocessing

    from ddtree_compile.testing import oracle

    args = argparse.Namespace(**setup["args"])
    mp = multiprocessing.get_context("spawn")  # (CUDA cannot be forked)
    devices = device_of_each(getattr(args, "devices", None), len(modes))
    workers, started = [], []
    try:
        # all engines start at once (a cold 4B engine takes ~4.5 min on the H100, mostly compile and
        # graph capture on one host thread each); engines sharing a GPU have fixed KV caches (start_engine)
        for (mode, budget, spec, extra), device in zip(modes, devices):
            share = devices.count(device)
            started.append(ModeWorker(mp, mode, budget, spec, extra, {**setup, "share": share}, device))
        for w in started:
            try:
                w.ready()
            except RuntimeError as e:
                result["runs"].append({"mode": w.mode, "error": str(e)[-500:]})
                continue
            result["starts"][w.mode] = w.info["start_s"]
            result.setdefault("worker_pids", {})[w.mode] = w.info["pid"]
            result.setdefault("worker_start_wall", {})[w.mode] = [w.info["spawned_s"], w.info["ready_s"]]
            if w.info["devices"] is not None:  # (as the worker's process saw them)
                result.setdefault("worker_devices", {})[w.mode] = w.info["devices"]
            if not w.info["attached"]:
                result["runs"].append({"mode": w.mode, "error": "DDTree did not attach",
                                       "fallbacks": w.info["fallbacks"]})
                continue  # (closed with the others below)
            workers.append(w)
        for prof in profiles:
            for w in workers:
                w.call("profile", prof)
            for c in setup["conc"]:
                # --warmup-runs: untimed, alternating too, so that each engine enters the cell at its steady
                # state (auto: its costs at this batch bucket, this profile's acceptance)
                warm = {w.mode: [] for w in workers}
                for i in range(getattr(args, "warmup_runs", 0)):
                    for w in _rotated(workers, i):
                        warm[w.mode].append(w.call("run", c)["started_s"])
                before = {w.mode: w.call("counters") for w in workers}
                runs, i = {w.mode: [] for w in workers}, 0
                while cells.more_runs(i, list(runs.values()), args.repeats, getattr(args, "min_cell_s", 0.0)):
                    for w in _rotated(workers, i):
                        runs[w.mode].append(w.call("run", c))
                    i += 1
                for w in workers:
                    rounds = cells.rounds_of(w.budget, before[w.mode], w.call("counters"))
                    rounds["run_started_s"] = [r["started_s"] for r in runs[w.mode]]  # the interleaving, on record
                    rounds["warmup_started_s"] = warm[w.mode]
                    cells.add_row(result, args, w.mode, w.budget, oracle.profile_from(prof), c,
                                  cells.median(runs[w.mode]), setup["ref"], {**rounds, **w.info["loop"]})
                save()
        # --gpu-profile after every timed cell, under the first profile: on the H100 the cells after a
        # profiled run read both engines' steps 1.1-1.5x those of a run without one (flat, thinking_2p5,
        # c = 1: 10.6 ms against 7.1), so no timed run may follow one
        at = cells.gpu_profile_at(args, setup["conc"], setup["conc"]) if profiles else []
        for w in workers if at else ():
            w.call("profile", profiles[0])
        for c in at:
            for w in workers:
                result.setdefault("gpu_profiles", []).append(
                    {"mode": w.mode, "profile": profiles[0]["name"], "concurrency": c, **w.call("gpu_profile", c)})
            save()
    finally:
        for w in started:
            w.close()


def _rotated(workers: list, i: int) -> list:
    """The workers in run order for repeat i: the order rotated by one per repeat."""
    return workers[i % len(workers):] + workers[:i % len(workers)]


def device_of_each(devices: str | None, n: int) -> list:
    """--devices "1,2,3" -> the CUDA_VISIBLE_DEVICES of each of n engines (the list repeats; indices
    into this process's CUDA_VISIBLE_DEVICES when it is set; "0+1" gives one engine GPUs 0 and 1, for
    --tensor-parallel-size 2); None: all on the default device."""
    if not devices:
        return [None] * n
    groups = [[d.strip() for d in g.split("+")] for g in devices.split(",") if g.strip()]
    if not groups or not all(d.isdigit() for g in groups for d in g):
        raise ValueError(f"--devices {devices!r}: expected CUDA device indices, e.g. '0', '1,2,3' or '0+1,2+3'")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        visible = visible.split(",")
        if max(int(d) for g in groups for d in g) >= len(visible):
            raise ValueError(f"--devices {devices!r}: CUDA_VISIBLE_DEVICES={','.join(visible)} holds "
                             f"{len(visible)} devices (indices 0..{len(visible) - 1})")
        groups = [[visible[int(d)] for d in g] for g in groups]
    return [",".join(groups[i % len(groups)]) for i in range(n)]


class ModeWorker:
    """--side-by-side: one speculative mode's engine in a process of its own (spawned), driven over a
    pipe. Two vLLM engines in one process share process-wide state: on the H100, vLLM 0.26 switches
    CUDA graph capture off for the whole process once an engine has captured, and the first engine's
    next run then failed ("CUDA graph capturing detected at an inappropriate time"); the Prometheus
    registry, which the spec-decode counters are read from, holds only the last engine's."""

    def __init__(self, mp, mode, budget, spec, extra, setup, device=None):
        self.mode, self.budget = mode, budget
        self.conn, child = mp.Pipe()
        # not a daemon: a daemonic process may not start processes of its own (torch.compile's workers)
        self.proc = mp.Process(target=worker_main, args=(child, mode, budget, spec, extra, setup))
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        if device is not None:  # a spawned process starts with the parent's environment of this moment
            os.environ["CUDA_VISIBLE_DEVICES"] = device
        try:
            self.proc.start()
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        child.close()
        self.spawned_s, self.info = time.time(), None

    def ready(self) -> dict:
        """Wait for the engine to be up: {start_s, attached, fallbacks, pid, ready_s}."""
        self.info = {**self._reply(), "spawned_s": self.spawned_s, "ready_s": time.time()}
        return self.info

    def call(self, *msg):
        self.conn.send(msg)
        return self._reply()

    def _reply(self):
        try:
            kind, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"{self.mode}: its process died (exit code {self.proc.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"{self.mode}: {value}")
        return value

    def close(self) -> None:
        try:
            self.conn.send(("close",))
        except OSError:
            pass
        self.proc.join(120)
        if self.proc.is_alive():
            self.proc.kill()


def worker_main(conn, mode, budget, spec, extra, setup) -> None:
    """A ModeWorker's process: start the engine, then answer ("profile", dict) (install that oracle
    profile, warm up), ("counters",) and ("run", c) until ("close",)."""
    import traceback

    from ddtree_compile.cli.timing import timed_steps
    from ddtree_compile.integration import engines, metrics, plugin
    from ddtree_compile.testing import harness, oracle

    args, conc, prompts = argparse.Namespace(**setup["args"]), setup["conc"], setup["prompts"]
    try:
        use_loop(loop_of(mode, args))
        plugin.register()
        llm, start = start_engine(args, setup["target"], conc, prompts, spec, extra, share=setup["share"], mode=mode)
        if getattr(args, "phase_timers", False):
            _phase_timers.install(llm)
            _step_clock.install(llm)
        if not budget or ddtree_attached(llm):
            force_chain(llm, mode)
        conn.send(("ok", {"start_s": start, "attached": not budget or ddtree_attached(llm),
                          "fallbacks": dict(metrics.PROCESS_STARTUP_FALLBACKS), "pid": os.getpid(),
                          "devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                          "loop": {"loop": loop_of(mode, args), **loop_info(llm)}}))
    except Exception:
        conn.send(("error", traceback.format_exc()[-2000:]))
        return
    reference, od = harness.reference_from_outputs(prompts, setup["ref"]), None
    try:
        while (msg := _recv(conn))[0] != "close":
            try:
                out = None
                if msg[0] == "profile":
                    if od is not None:
                        od.uninstall()
                    od = install_oracle(llm, reference, oracle.profile_from(msg[1]), prompts, conc)
                elif msg[0] == "counters":
                    out = cells.counters(llm, budget)
                elif msg[0] == "run":
                    out = timed_steps(llm, prompts[: msg[1]], args.max_tokens)
                elif msg[0] == "gpu_profile":
                    out = cells.gpu_profile(llm, prompts[: msg[1]], args.max_tokens, budget)
                conn.send(("ok", out))
            except Exception:
                conn.send(("error", traceback.format_exc()[-2000:]))
    finally:
        engines.shutdown(llm)


def _recv(conn) -> tuple:
    """The next message; a closed pipe (the parent died or was killed) is a close."""
    try:
        return conn.recv()
    except EOFError:
        return ("close",)
