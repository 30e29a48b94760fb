"""CUDA graphs of a round stage's device work (the walk, the commit), one per input shape.

After the tree verify the commit is ~40 small torch ops and 4-6 Triton launches per step, and their
host cost sits on the round's critical path: vLLM waits on the sampled tokens right after. On the
H100 (4B shape, c=1, benchmarks/_phase_timers.py) it was ~1.1 ms of a 15 ms step. One graph per
shape replays the same work in one launch.

What a stage reads is split in two. `copied`: tensors that are new every step (the walk's paths,
vLLM's addressing); they are copied into the graph's own buffers before each replay. `fixed`:
tensors at fixed addresses (the KV caches, the GDN state, the workspace's records); their
addresses are part of the key, so a graph never reads a stale one. The stage's function must do
device work only: it runs once eagerly per key (Triton compiles, the launchers' cached tables),
once under capture, and from then on only replays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MAX_GRAPHS = 256  # beyond this many shapes the stage runs eagerly (logged once)


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    inputs: dict
    outputs: object  # what the stage's function returned at capture


class StageGraphs:
    def __init__(self, ctx, name: str, enabled: bool):
        self.ctx, self.name = ctx, name
        self.on = enabled and ctx.device.type == "cuda"
        self._graphs: dict[tuple, _Graph] = {}
        self._seen: set[tuple] = set()
        self._pool = None
        self.replayed = False  # the last run replayed a graph: what it returned are the graph's buffers

    def run(self, fn, copied: dict, fixed: dict):
        """fn(**copied, **fixed): eagerly, or by replaying the graph of these shapes and addresses.
        Returns fn's result; from a replay, the tensors it returned at capture (the graph's buffers,
        overwritten by its next replay: at fixed addresses)."""
        self.replayed = False
        if not self.on:
            return fn(**copied, **fixed)
        key = (tuple((k, tuple(v.shape), v.dtype, v.stride()) for k, v in copied.items())
               + tuple((k, v.data_ptr(), tuple(v.shape), v.dtype, v.stride()) for k, v in fixed.items()))
        g = self._graphs.get(key)
        if g is None:
            if key not in self._seen or len(self._graphs) >= _MAX_GRAPHS:
                if len(self._graphs) >= _MAX_GRAPHS:
                    self.ctx.log_once(f"stage_graphs:{self.name}", "DDTree: %d CUDA graphs of the %s stage; further "
                                      "shapes run eagerly", _MAX_GRAPHS, self.name)
                self._seen.add(key)
                self.ctx.metrics.stage_eager[self.name] += 1
                return fn(**copied, **fixed)
            g = self._capture(key, fn, copied, fixed)
        for k, v in copied.items():
            g.inputs[k].copy_(v, non_blocking=True)
        g.graph.replay()
        self.ctx.metrics.stage_replays[self.name] += 1
        self.replayed = True
        return g.outputs

    def _capture(self, key, fn, copied: dict, fixed: dict) -> _Graph:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        inputs = {k: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                  for k, v in copied.items()}
        graph = torch.cuda.CUDAGraph()
        # thread_local: vLLM's other threads (outputs, metrics) may touch CUDA meanwhile
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = fn(**inputs, **fixed)
        self._graphs[key] = g = _Graph(graph, inputs, outputs)
        self.ctx.metrics.stage_graphs[self.name] = len(self._graphs)
        return g

    def close(self) -> None:
        self._graphs.clear()
        self._seen.clear()
        self._pool = None
