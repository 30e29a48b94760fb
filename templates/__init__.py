"""Tree-aware kernels: Triton for CUDA, each with its plain torch reference beside it.

Convention: `<name>.py` holds the Triton kernels and their launcher, `<name>_ref.py` the plain torch
reference and the argument checks the launcher shares. ops.py registers every `ddtree::` custom op
(CPU kernel = the reference, CUDA kernel = the launcher, fake = the checks); import it to use them.

    op / path                 kernel module       reference module
    ddtree::tree_attention    tree_attention.py   tree_attention_ref.py  (tree_attention_scratch: the
                                                                       same, partials in the caller's scratch)
    ddtree::kv_compact        kv_compact.py       kv_compact_ref.py
    ddtree::tree_conv1d       tree_conv.py        tree_conv_ref.py
    ddtree::tree_gdn          tree_gdn.py         tree_gdn_ref.py
    ddtree::gdn_commit        gdn_commit.py       gdn_commit_ref.py
    draft top-k (no op)       draft_topk.py       core/build.py `draft_topk`
    tree build (no op)        tree_build.py       core/build.py `_build`
    GDN tree metadata (no op) gdn_meta_triton.py  gdn_meta.py `build_gdn_meta`
    GDN resume (no op)        gdn_resume.py       gdn_resume_ref.py  (vLLM 0.26's draft-less rows,
                                                                       adapters/gdn_resume.py)

The last four are not ops: their callers (core/build.py, gdn_step.make_gdn_meta, gdn_resume's
dispatcher) run the Triton kernels in place of their torch code on CUDA (or when asked to), so that
torch code is their reference. The round's eager commit calls gdn_commit's and kv_compact's launchers directly on CUDA.

Shared: tuning.py (launch parameters per GPU and the tree-attention bucket plan), launch.py (direct
Triton launches), gdn_meta.py (per-step tree metadata of the GDN kernels, and its reference), gdn_step.py (the GDN
verify / commit calls the integration makes).
"""
