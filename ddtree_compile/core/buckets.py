"""The round's bucket arithmetic in one place, as sympy expressions.

    symbol  meaning
    b       a tree bucket's nodes (the budget B for the largest)
    L       the drafter's draft length (flat DFlash's chain)
    k       top_k: candidates per depth
    R       requests in a batch
    q       tokens per request of a uniform batch
    n       GatedDeltaNet layers in a KV cache group (in the state memory: all of the target's)
    H, K    GDN key heads and key head size; HV, V: value heads and value head size
    C, W    GDN conv channels (per rank) and conv kernel width; E, F: bytes of a conv / SSM state value
    S, P    GDN state slots per request, and the bytes of one slot over every GDN layer (vLLM's pages)

The capture (round/graphs.py, the vLLM 0.26 adapter's FULL keys), budget "auto" (its batch buckets),
the precompile command (the batch sizes it times), the memory plan (round/workspace.py), vLLM's draft
slots (integration/config.py) and the per-request GDN state memory (round/state.py logs it) evaluate
these expressions instead of restating them; `ddtree_compile.core.buckets.EXPRESSIONS` lists them.
Evaluation substitutes integers and is exact (sympy's integer arithmetic, floor of a log included),
cached per argument tuple: the hot path (auto's bucket per step) pays a dict lookup.
"""

from __future__ import annotations

import functools

import sympy as sp

b, L, k, R, q, d = sp.symbols("b L k R q d", integer=True, positive=True)
n, H, K, HV, V = sp.symbols("n H K HV V", integer=True, positive=True)
C, W, E, F, P, S = sp.symbols("C W E F P S", integer=True, positive=True)

VERIFY_TOKENS = b + 1  # a tree bucket's tokens per request: the root (last step's bonus) + b nodes
CHAIN_TOKENS = L + 1  # the chain's: flat DFlash's verify of L drafts
CAPTURE_TOKENS = R * q  # a FULL CUDA graph of R uniform requests of q tokens
BATCH_BUCKET = 2 ** sp.floor(sp.log(R, 2))  # budget "auto"'s cost bucket: the largest power of two <= R
TREE_CAPACITY = sp.Sum(k**d, (d, 1, L))  # nodes a top-k x L tree can hold (k per depth, L depths)
EFFECTIVE_BUDGET = sp.Min(b, TREE_CAPACITY)  # the budget a tree can fill: a tree never has padding slots
# the round's GDN workspace (round/workspace.py), shapes for R requests and b-node trees: per KV cache
# group the per-node k and v of every GDN layer (model dtype) and g and beta (float32); the tree GDN
# kernel's state at each depth where its walk branches (float32), shared by every layer: a drafter's tree
# is at most L deep, so its branch points lie above depth L (chain rows, the padded rows' contents too,
# have none), and min(b, L) levels hold every save (tree_context.GdnVerify.levels)
GDN_SHAPES = {"rec_kv": (n, R, VERIFY_TOKENS, H * K + HV * V), "rec_gb": (n, R, VERIFY_TOKENS, 2, HV),
              "stack": (R, sp.Min(b, L), HV, V, K)}
# vLLM's num_speculative_tokens as the switch sets it for an effective budget b: its draft slots hold
# the tree and the drafter's block
DRAFT_SLOTS = sp.Max(b, L)
# GDN state per request: vLLM allots each request 1 + S state slots per GDN KV cache group, each one
# conv state and one SSM state of every layer (MambaSpec.num_speculative_blocks = S). Snapshots keep
# vLLM's S = num_speculative_tokens (a state per tree node); replay needs S = L, the chain's
# (adapters/gdn_slots.py). A slot's conv state keeps W - 1 + num_speculative_tokens columns either
# way (the tree conv stores every node's input in the request's line), so replay's bytes still grow
# with b, through the conv part only.
GDN_SLOTS = {"replay": 1 + L, "snapshots": 1 + DRAFT_SLOTS}
GDN_SLOT_BYTES = n * (C * (W - 1 + DRAFT_SLOTS) * E + HV * V * K * F)  # unpadded; vLLM may pad pages
GDN_REQUEST_BYTES = S * P  # as allotted: the request's slots x vLLM's bytes per slot

EXPRESSIONS = {"verify_tokens": VERIFY_TOKENS, "chain_tokens": CHAIN_TOKENS, "capture_tokens": CAPTURE_TOKENS,
               "batch_bucket": BATCH_BUCKET, "tree_capacity": TREE_CAPACITY, "effective_budget": EFFECTIVE_BUDGET,
               "draft_slots": DRAFT_SLOTS, "gdn_slots_replay": GDN_SLOTS["replay"],
               "gdn_slots_snapshots": GDN_SLOTS["snapshots"], "gdn_slot_bytes": GDN_SLOT_BYTES,
               "gdn_request_bytes": GDN_REQUEST_BYTES}


_EVALUABLE = {name: expr.doit() for name, expr in EXPRESSIONS.items()}  # the sum in closed form, once


@functools.lru_cache(maxsize=4096)
def _eval(name: str, values: tuple) -> int:
    """values: ((symbol name, int), ...): plain keys, so a cache hit hashes no sympy objects."""
    out = _EVALUABLE[name].subs(_symbols(values))
    if not out.is_Integer:
        out = sp.simplify(out)
    if not out.is_Integer:
        raise ValueError(f"buckets.{name}{dict(values)} is not an integer: {out}")
    return int(out)


def _ints(**values) -> tuple:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"buckets: `{name}` must be an int >= 1, got {v!r}")
    return tuple(sorted(values.items()))


def _symbols(values: tuple) -> dict:
    return {globals()[name]: v for name, v in values}


def verify_tokens(budget: int) -> int:
    return _eval("verify_tokens", _ints(b=budget))


def chain_tokens(draft_len: int) -> int:
    return _eval("chain_tokens", _ints(L=draft_len))


def capture_tokens(requests: int, tokens_per_request: int) -> int:
    return _eval("capture_tokens", _ints(R=requests, q=tokens_per_request))


_BATCH_BUCKETS: dict[int, int] = {}  # requests -> bucket: budget "auto" asks several times a step


def batch_bucket(requests: int) -> int:
    b = _BATCH_BUCKETS.get(requests) if type(requests) is int else None  # (a bool is checked by _ints)
    if b is None:
        b = _eval("batch_bucket", _ints(R=max(requests, 1)))
        if type(requests) is int:
            _BATCH_BUCKETS[requests] = b
    return b


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes the precompile command times: every bucket below max_batch, and max_batch."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
    return sorted({batch_bucket(r) for r in range(1, max_batch)} | {max_batch})


def effective_budget(budget: int, top_k: int, draft_len: int) -> int:
    """min(budget, nodes a top_k x draft_len tree can hold)."""
    return _eval("effective_budget", _ints(b=budget, k=min(top_k, budget), L=draft_len))


def gdn_workspace(layers: int, requests: int, budget: int, draft_len: int, key_heads: int, key_dim: int,
                  value_heads: int, value_dim: int) -> dict:
    """name -> shape of the GDN workspace: rec_kv and rec_gb of `layers` GDN layers, the shared stack."""
    v = _symbols(_ints(n=layers, R=requests, b=budget, L=draft_len, H=key_heads, K=key_dim, HV=value_heads,
                       V=value_dim))
    return {name: tuple(int(sp.sympify(x).subs(v)) for x in shape) for name, shape in GDN_SHAPES.items()}


def draft_slots(budget: int, draft_len: int) -> int:
    """vLLM's num_speculative_tokens for an effective budget: max(b, L)."""
    return _eval("draft_slots", _ints(b=budget, L=draft_len))


def gdn_state_slots(strategy: str, budget: int, draft_len: int) -> int:
    """GDN state slots per request a strategy needs ("replay": 1 + L; "snapshots": 1 + max(b, L))."""
    if strategy not in GDN_SLOTS:
        raise ValueError(f"buckets: `strategy` must be one of {', '.join(GDN_SLOTS)}, got {strategy!r}")
    return _eval(f"gdn_slots_{strategy}", _ints(b=budget, L=draft_len))


def gdn_slot_bytes(layers: int, conv_channels: int, conv_width: int, value_heads: int, value_dim: int, key_dim: int,
                   budget: int, draft_len: int, conv_bytes: int = 2, state_bytes: int = 2) -> int:
    """Bytes of one GDN state slot over `layers` layers (unpadded pages), for vLLM's draft slots of b, L."""
    return _eval("gdn_slot_bytes", _ints(n=layers, C=conv_channels, W=conv_width, HV=value_heads, V=value_dim,
                                         K=key_dim, b=budget, L=draft_len, E=conv_bytes, F=state_bytes))


def gdn_request_bytes(slots: int, slot_bytes: int) -> int:
    """One request's GDN state: its slots x the bytes of one slot over every GDN layer."""
    return _eval("gdn_request_bytes", _ints(S=slots, P=slot_bytes))
