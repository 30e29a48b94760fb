"""FULL CUDA graphs of the tree verify: the static metadata of each (budget, padded batch) bucket.

vLLM captures one FULL graph per uniform-decode batch size: R_pad requests of 1 + K tokens, and
here K = num_speculative_tokens = B, so a tree verify (B + 1 slots per request) is such a batch.
The budget bucket is the engine's B (vLLM has one uniform decode length per engine); the batch
buckets are vLLM's capture sizes. The ddtree mirror ops choose tree vs original in Python, which
a graph freezes at capture, so:

- capture: the adapter runs vLLM's own warm-up and capture forwards of every FULL uniform size
  inside `GraphBuckets.capture(num_tokens, capturing)`, whose set-up copies run outside the graph: a tree verify
  over this module's metadata tensors (chain-shaped trees over no context), so the graph records
  the tree templates and their reads of these addresses. A size whose capture did not reach every layer's tree op raises.
- replay: the step's trees are copied into the first R rows of its bucket's tensors and the
  padded rows R..R_pad get chain trees over no context (vLLM gives those rows NULL_BLOCK_ID state
  lines and skipped KV slots). A replayed graph runs none of the ops' Python, so an empty call
  count after the forward means a replay (counted as graph_steps).

One buffer per tensor, sized for the largest batch; bucket R_pad uses its first R_pad rows, so
every bucket's graph reads fixed addresses. The workspace (GDN records and depth stack, tree
attention's scratch: workspace.py) is shared the same way: allocated inside a capture, it would be
held by the graph pool once per bucket. What the ops compute from the tree (the GDN walk order) is built inside the
graph and so recomputed at every replay.
"""

from __future__ import annotations

import contextlib

import torch

from ..tree_context import TreeVerifyMetadata, tree_verify
from .checks import check_reached
from .step import RoundContext


class GraphBuckets:
    def __init__(self, ctx: RoundContext, gdn_verify, chain, attn_scratch):
        """gdn_verify(rows, records) -> the GdnVerify of a batch of `rows` (verify_stage: the
        workspace's stack and records); chain: (parents [N], depths [N], ancestor bits [N, W]) of
        the chain-shaped tree (verify_stage); attn_scratch: the workspace's tree-attention scratch
        (None: the op needs none here)."""
        self.ctx = ctx
        self._gdn_verify = gdn_verify
        self._attn_scratch = attn_scratch
        self._chain_row = chain
        self.captured: set[int] = set()  # R_pad whose FULL graph holds the tree ops
        self._metas: dict[int, TreeVerifyMetadata] = {}
        self._buf = None
        # vLLM's uniform decode batch is 1 + K tokens per request: trees of B + 1 slots only when
        # K == B (vllm_kwargs sets it so whenever B >= L); otherwise tree verifies are not uniform,
        # never replay a FULL graph, and those graphs keep the original ops.
        self.K = ctx.view.settings.num_speculative_tokens

    def _buffers(self):
        if self._buf is None:
            ctx = self.ctx
            R = ctx.view.max_num_reqs
            # Chain trees (the padded rows' contents) and the live buffers, same dtypes as core.tree.
            self._chain = tuple(t.expand(R, *t.shape).contiguous() for t in self._chain_row)
            self._buf = tuple(t.clone() for t in self._chain) + (torch.zeros(R, dtype=torch.int32, device=ctx.device),)
        return self._buf

    def meta(self, rows: int) -> TreeVerifyMetadata:
        """The static metadata of bucket `rows` (the same tensors at every call)."""
        if rows not in self._metas:
            parents, depths, bits, lens = self._buffers()
            gdn = None
            if self.ctx.hybrid:  # records always: the graph writes them whether or not a test reads them
                gdn = self._gdn_verify(rows, records=True)
            self._metas[rows] = TreeVerifyMetadata(ancestor_bits=bits[:rows], depths=depths[:rows],
                                                   parents=parents[:rows], context_lens=lens[:rows],
                                                   attn_scratch=self._attn_scratch, gdn=gdn)
        return self._metas[rows]

    def _neutral(self, meta: TreeVerifyMetadata, start: int) -> None:
        """Rows start.. of the bucket: chain trees over no context. Never recorded into a graph: a
        capture forward entered inside the graph being captured (Model Runner V2 calls the model
        inside `torch.cuda.graph`) finds the rows as its warm-up, run just before, left them."""
        rows = meta.num_requests
        if start < rows and not torch.cuda.is_current_stream_capturing():
            parents, depths, bits = self._chain
            meta.parents[start:].copy_(parents[start:rows])
            meta.depths[start:].copy_(depths[start:rows])
            meta.ancestor_bits[start:].copy_(bits[start:rows])
            meta.context_lens[start:].zero_()
        meta.calls.clear()
        if meta.gdn is not None:  # the ops rebuild it from `parents` inside the graph being captured
            meta.gdn.tree_meta = None

    def close(self) -> None:
        """Drop the buckets' tensors (the engine shut down; its graphs are gone with it)."""
        self._metas.clear()
        self._attn_scratch = None
        self._buf = self._chain = None
        self.captured.clear()

    # -- capture -----------------------------------------------------------------------------------
    def capture(self, num_tokens: int, capturing: bool):
        """The tree context of one of vLLM's FULL-graph warm-up (`capturing` False) or capture
        forwards, entered outside the graph being captured, or None when
        `num_tokens` is not a batch of whole trees (that graph then holds the original ops, and
        a tree step never replays it: `replay_rows` refuses)."""
        N = self.ctx.N
        if self.K != self.ctx.B:
            self.ctx.log_once("graph:K", "DDTree: num_speculative_tokens %d != budget %d: FULL CUDA graphs hold "
                              "vLLM's chain verify; tree verifies run PIECEWISE", self.K, self.ctx.B)
            return None
        if num_tokens % N or not 0 < num_tokens // N <= self.ctx.view.max_num_reqs:
            self.ctx.log_once(f"graph:{num_tokens}", "DDTree: FULL CUDA graph of %d tokens is not a batch of "
                              "trees of %d slots: captured without the tree verify", num_tokens, N)
            return None
        return self._capturing(num_tokens // N, capturing)

    @contextlib.contextmanager
    def _capturing(self, rows: int, capturing: bool):
        meta = self.meta(rows)
        self._neutral(meta, 0)  # outside the graph: a replay must not reset the step's trees
        if meta.gdn is not None:
            # vLLM's warm-up runs (eager, before each capture) build non-spec GDN metadata, so they
            # get the null state line (block 0, never a request's) and one accepted token; the
            # capture itself reads vLLM's persistent spec buffers, which replays then hold.
            null = None if capturing else (torch.zeros(rows, self.ctx.N, dtype=torch.int32, device=self.ctx.device),
                                           torch.ones(rows, dtype=torch.int32, device=self.ctx.device))
            meta.gdn.state_indices, meta.gdn.num_accepted = null or (None, None)
        with tree_verify(meta):
            yield meta
        check_reached(self.ctx, meta.calls, f"FULL CUDA graph of {rows} trees")
        if capturing:
            self.captured.add(rows)
            self.ctx.metrics.graph_sizes = sorted(self.captured)

    # -- replay ------------------------------------------------------------------------------------
    def replay_rows(self, num_tokens: int | None) -> int | None:
        """R_pad when this forward replays a FULL graph of `num_tokens` tokens (None: the ops' Python
        runs, PIECEWISE or eager). A FULL graph captured without the tree ops must never replay a
        tree verify: that raises."""
        if num_tokens is None:
            return None
        rows, rest = divmod(num_tokens, self.ctx.N)
        if rest or rows not in self.captured:
            raise RuntimeError(f"DDTree: a tree verify of {num_tokens} tokens would replay a FULL CUDA graph "
                               f"captured without the tree ops (captured with them: {sorted(self.captured)} trees)")
        return rows

    def check_plain_forward(self, num_tokens: int | None) -> None:
        """A forward without a Step must not replay a graph that holds the tree ops (its metadata
        would be the last step's): uniform fallbacks are verified as chain-shaped Steps instead."""
        if num_tokens is not None and num_tokens % self.ctx.N == 0 and num_tokens // self.ctx.N in self.captured:
            raise RuntimeError(f"DDTree: a step without trees would replay the tree verify's FULL CUDA graph of "
                               f"{num_tokens} tokens")

    def fill(self, rows: int, step) -> TreeVerifyMetadata:
        """The bucket's metadata holding this step's trees in its first step.R rows."""
        meta = self.meta(rows)
        R, src = step.R, step.meta
        meta.ancestor_bits[:R].copy_(src.ancestor_bits)
        meta.depths[:R].copy_(src.depths)
        meta.parents[:R].copy_(src.parents)
        meta.context_lens[:R].copy_(src.context_lens)
        self._neutral(meta, R)
        return meta
