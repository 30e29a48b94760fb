"""FULL CUDA graphs of the tree verify: the static metadata of each (tree bucket, padded batch).

vLLM captures one FULL graph per uniform-decode batch: R_pad requests of q tokens. vLLM's own q
is 1 + K (K = num_speculative_tokens = B, so the largest tree of B + 1 slots is such a batch); the
adapter adds FULL graphs for the other query lengths the round asks for (`query_lens`): every
smaller tree bucket of budget "auto"'s menu (b + 1 slots) and the chain (L + 1 tokens, flat
DFlash's verify). Buckets are keyed (N, R_pad). The ddtree mirror ops choose tree vs original in
Python, which a graph freezes at capture, so:

- capture: the adapter runs vLLM's own warm-up and capture forwards of every FULL uniform batch
  inside `GraphBuckets.capture(num_tokens, num_reqs, capturing)`, whose set-up copies run outside
  the graph: for a tree bucket a tree verify over this module's metadata tensors (chain-shaped trees
  over no context), so the graph records the tree templates and their reads of these addresses; the
  chain's batches get no tree context (the graph is flat DFlash's, vLLM's ops). A tree bucket's
  capture that did not reach every layer's tree op raises.
- replay: the step's trees are copied into the first R rows of its bucket's tensors and the
  padded rows R..R_pad get chain trees over no context (vLLM gives those rows NULL_BLOCK_ID state
  lines and skipped KV slots). Where the drafter builds the trees into fixed buffers (Model Runner
  V2: inside its graph, round/build_stage.py), a bucket's tree tensors are those buffers: a step of
  the drafter's trees, in the drafter's row order, is read in place (only its context lengths are
  written); another step's trees (rows gathered, chain rows, chain-shaped Steps) are copied there,
  which the next proposal's drafter overwrites anyway. A replayed graph runs none of the ops' Python, so an empty call
  count after the forward means a replay (counted as graph_steps).

One buffer per tensor and tree bucket, sized for the largest batch; bucket (N, R_pad) uses its first
R_pad rows, so every graph reads fixed addresses. The workspace (GDN records and depth stack, tree
attention's scratch: workspace.py) is shared by all buckets: allocated inside a capture, it would
be held by the graph pool once per bucket. What the ops compute from the tree (the GDN walk order)
is built inside the graph and so recomputed at every replay.
"""

from __future__ import annotations

import contextlib

import torch

from ...core.buckets import chain_tokens, verify_tokens
from ...core.tree import num_mask_words
from ..tree_context import TreeVerifyMetadata, tree_verify
from .checks import check_reached
from .step import RoundContext


class GraphBuckets:
    def __init__(self, ctx: RoundContext, gdn_verify, chain, attn_scratch, trees_of=None):
        """gdn_verify(rows, N, records) -> the GdnVerify of a batch of `rows` N-slot trees (verify_stage: the
        workspace's stack and records); chain: (parents [N], depths [N], ancestor bits [N, W]) of
        the chain-shaped tree of the largest bucket (verify_stage); attn_scratch: the workspace's
        tree-attention scratch (None: the op needs none here); trees_of(N) -> the fixed buffers
        (TreeBatch, every request's row) the drafter builds N-slot trees into, or None."""
        self.ctx = ctx
        self._trees_of = trees_of
        self._gdn_verify = gdn_verify
        self._attn_scratch = attn_scratch
        self._chain_row = chain
        self.captured: set[tuple[int, int]] = set()  # (N, R_pad) whose FULL graph holds the tree ops
        self.chain_captured: set[int] = set()  # R_pad of the chain's FULL graphs (vLLM's ops)
        self._metas: dict[tuple[int, int], TreeVerifyMetadata] = {}
        self._buf: dict[int, tuple] = {}  # N -> (chain trees [R, ...], live buffers [R, ...])

    def query_lens(self) -> set[int]:
        """The uniform query lengths to capture FULL graphs of: every tree bucket's slots, the chain's
        L + 1 with budget "auto" (flat DFlash's verify)."""
        ctx = self.ctx
        return {verify_tokens(b) for b in ctx.menu} | ({chain_tokens(ctx.L)} if ctx.chain_steps else set())

    def holds_trees(self, N: int) -> bool:
        """Whether some FULL graph of N-slot batches holds the tree ops (a forward of such a batch must
        then be a Step: the graph would read the last step's trees)."""
        return any(n == N for n, _ in self.captured)

    def _buffers(self, N: int):
        if N not in self._buf:
            ctx = self.ctx
            R = ctx.view.max_num_reqs
            parents, depths, bits = self._chain_row
            row = (parents[:N], depths[:N], bits[:N, :num_mask_words(N)])
            # Chain trees (the padded rows' contents) and the live buffers, same dtypes as core.tree.
            chain = tuple(t.expand(R, *t.shape).contiguous() for t in row)
            trees = self._trees_of(N) if self._trees_of is not None else None
            built = None if trees is None else (trees.parents, trees.depths, trees.ancestor_bits)
            if built is None or any(b.shape != c.shape or b.dtype != c.dtype for b, c in zip(built, chain)):
                built = tuple(t.clone() for t in chain)
            self._buf[N] = chain, built + (torch.zeros(R, dtype=torch.int32, device=ctx.device),)
        return self._buf[N]

    def meta(self, N: int, rows: int) -> TreeVerifyMetadata:
        """The static metadata of bucket (N, rows) (the same tensors at every call)."""
        if (N, rows) not in self._metas:
            parents, depths, bits, lens = self._buffers(N)[1]
            gdn = None
            if self.ctx.hybrid:  # records always: the graph writes them whether or not a test reads them
                gdn = self._gdn_verify(rows, N, records=True)
            self._metas[N, rows] = TreeVerifyMetadata(ancestor_bits=bits[:rows], depths=depths[:rows],
                                                      parents=parents[:rows], context_lens=lens[:rows],
                                                      attn_scratch=self._attn_scratch, gdn=gdn)
        return self._metas[N, rows]

    def _neutral(self, meta: TreeVerifyMetadata, start: int) -> None:
        """Rows start.. of the bucket: chain trees over no context. Never recorded into a graph: a
        capture forward entered inside the graph being captured (Model Runner V2 calls the model
        inside `torch.cuda.graph`) finds the rows as its warm-up, run just before, left them."""
        rows = meta.num_requests
        if start < rows and not torch.cuda.is_current_stream_capturing():
            parents, depths, bits = self._buffers(meta.parents.shape[1])[0]
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
        self._buf.clear()
        self.captured.clear()
        self.chain_captured.clear()

    # -- capture -----------------------------------------------------------------------------------
    def capture(self, num_tokens: int, num_reqs: int, capturing: bool):
        """The tree context of one of vLLM's FULL-graph warm-up (`capturing` False) or capture
        forwards, entered outside the graph being captured, or None when the batch is not one of a
        tree bucket (that graph then holds the original ops: the chain's is flat DFlash's graph; a
        tree step never replays another: `replay_rows` refuses)."""
        ctx = self.ctx
        N, rest = divmod(num_tokens, max(num_reqs, 1))
        tree = not rest and N - 1 in ctx.menu and 0 < num_reqs <= ctx.view.max_num_reqs
        if not tree:
            if not rest and N == chain_tokens(ctx.L) and ctx.chain_steps:
                if capturing:
                    self.chain_captured.add(num_reqs)
                    ctx.metrics.chain_graph_sizes = sorted(self.chain_captured)
            else:
                slots = "/".join(str(verify_tokens(b)) for b in ctx.menu)
                ctx.log_once(f"graph:{num_tokens}/{num_reqs}", "DDTree: FULL CUDA graph of %d tokens for %d "
                             "requests is not a batch of trees of a bucket's size (%s slots): captured "
                             "without the tree verify", num_tokens, num_reqs, slots)
            return None
        return self._capturing(N, num_reqs, capturing)

    @contextlib.contextmanager
    def _capturing(self, N: int, rows: int, capturing: bool):
        meta = self.meta(N, rows)
        self._neutral(meta, 0)  # outside the graph: a replay must not reset the step's trees
        if meta.gdn is not None:
            # vLLM's warm-up runs (eager, before each capture) build non-spec GDN metadata, so they
            # get the null state line (block 0, never a request's) and one accepted token; the
            # capture itself reads vLLM's persistent spec buffers, which replays then hold.
            null = None if capturing else (torch.zeros(rows, N, dtype=torch.int32, device=self.ctx.device),
                                           torch.ones(rows, dtype=torch.int32, device=self.ctx.device))
            meta.gdn.state_indices, meta.gdn.num_accepted = null or (None, None)
        with tree_verify(meta):
            yield meta
        check_reached(self.ctx, meta.calls, f"FULL CUDA graph of {rows} trees of {N} slots")
        if capturing:
            self.captured.add((N, rows))
            m = self.ctx.metrics
            m.graph_sizes = sorted(r for n, r in self.captured if n == self.ctx.N)
            slots = {k for k, _ in self.captured}
            m.graph_buckets = {n - 1: sorted(r for k, r in self.captured if k == n) for n in slots}

    # -- replay ------------------------------------------------------------------------------------
    def replay_rows(self, batch: tuple[int, int] | None, N: int) -> int | None:
        """R_pad when this forward (a Step of N slots per request) replays a FULL graph of `batch` =
        (tokens, requests) (None: the ops' Python runs, PIECEWISE or eager). A FULL graph captured
        without the tree ops of N-slot trees must never replay a tree verify: that raises."""
        if batch is None:
            return None
        tokens, rows = batch
        if tokens != rows * N or (N, rows) not in self.captured:
            raise RuntimeError(f"DDTree: a tree verify of {N}-slot trees would replay a FULL CUDA graph of {tokens} "
                               f"tokens for {rows} requests captured without them (captured with tree ops: "
                               f"{sorted(self.captured)} (slots, requests))")
        return rows

    def check_plain_forward(self, batch: tuple[int, int] | None) -> bool:
        """A forward without a Step must not replay a graph that holds the tree ops (its metadata
        would be the last step's): uniform fallbacks are verified as chain-shaped Steps instead.
        Returns whether it replays a FULL graph (the chain's)."""
        if batch is None:
            return False
        tokens, rows = batch
        if tokens % rows == 0 and (tokens // rows, rows) in self.captured:
            raise RuntimeError(f"DDTree: a step without trees would replay the tree verify's FULL CUDA graph of "
                               f"{tokens} tokens for {rows} requests")
        return True

    def fill(self, N: int, rows: int, step) -> TreeVerifyMetadata:
        """The bucket's metadata holding this step's trees in its first step.R rows."""
        meta = self.meta(N, rows)
        R, src = step.R, step.meta
        for dst, got in ((meta.ancestor_bits, src.ancestor_bits), (meta.depths, src.depths),
                         (meta.parents, src.parents)):
            if got.data_ptr() != dst.data_ptr() or got.stride() != dst.stride():  # (else the drafter's, in place)
                dst[:R].copy_(got)
        meta.context_lens[:R].copy_(step.start)  # (int32 from vLLM's positions: one launch)
        self._neutral(meta, R)
        return meta
