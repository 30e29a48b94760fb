"""ddtree_compile: DDTree speculative decoding for vLLM, built as FX graph passes and tree kernels.

    core/         the tree algorithm (no vLLM): spec, tree layout, build, walk, commit plan, sampling
    adapters/     every assumption about vLLM's internals, one module per release line
    integration/  DDTree inside vLLM: switch, plugin, the op swap, KV layouts, metrics, round/
    cli/          the `ddtree-compile` command: round (toy round), dump, precompile
    testing/      test and benchmark support (tiny models, drafter harness, oracle, demo), never imported by the product
    passes/       the FX rewrite rules and engine          (installed as ddtree_compile.passes)
    templates/    tree-aware kernels and their references  (installed as ddtree_compile.templates)

One round: build (core/build.py) -> verify (the target forward through passes/ and templates/)
-> walk (core/walk.py) -> commit (core/commit.py); inside vLLM, integration/round/ runs the same
four stages on the model runner.
"""

from .core.build import build_tree, draft_topk
from .core.commit import CommitPlan, commit_plan
from .core.sampling import sample_target_tokens
from .core.spec import TreeSpec
from .core.tree import TreeBatch, WalkResult
from .core.walk import walk_tree
from .integration.config import vllm_kwargs  # the one switch that turns DDTree on in vLLM
from .passes.entry import tree_verify_pass  # vLLM looks the pass up as ddtree_compile.tree_verify_pass

__version__ = "0.1.0"

__all__ = [
    "TreeSpec", "TreeBatch", "WalkResult", "CommitPlan",
    "build_tree", "draft_topk", "walk_tree", "commit_plan", "sample_target_tokens",
    "tree_verify_pass", "vllm_kwargs", "__version__",
]
