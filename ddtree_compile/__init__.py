"""ddtree_compile: DDTree speculative decoding for vLLM, built as FX graph passes and tree kernels.

One round: build (build.py) -> verify (the target forward through passes/ and templates/) ->
walk (walk.py) -> commit (commit.py).
"""

from .build import build_tree, draft_topk
from .commit import CommitPlan, commit_plan
from .config import vllm_kwargs  # the one switch that turns DDTree on in vLLM
from .passes.entry import tree_verify_pass  # vLLM looks the pass up as ddtree_compile.tree_verify_pass
from .sampling import sample_target_tokens
from .spec import TreeSpec, bucket_for, budget_buckets
from .tree import TreeBatch
from .walk import WalkResult, walk_tree

__version__ = "0.1.0"

__all__ = [
    "TreeSpec", "TreeBatch", "WalkResult", "CommitPlan",
    "build_tree", "draft_topk", "walk_tree", "commit_plan", "sample_target_tokens",
    "budget_buckets", "bucket_for", "tree_verify_pass", "vllm_kwargs", "__version__",
]
