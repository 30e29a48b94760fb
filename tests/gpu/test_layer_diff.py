"""DDTree's verify follows vLLM's arithmetic layer by layer (issue 28, benchmarks/results/INDEX.md "Long
context on the GPU"): vLLM's flat DFlash and DDTree with top_k 1 (every tree a plain chain of L = 7
drafts: flat DFlash's drafts, accepted lengths and verify batches) on the same long prompt.

The verify differs only in the target's kernels: DDTree's tree attention / tree conv1d / tree
GatedDeltaNet templates where flat DFlash runs vLLM's FlashAttention / causal_conv1d_update /
fused_sigmoid_gating_delta_rule_update. On CUDA the GDN templates follow vLLM's arithmetic (bf16
products, reduction order), so the GatedDeltaNet layers before the first attention layer must give
bit-identical outputs, every layer stays within bf16 rounding (relative 2e-2) and the tokens are equal.
Two eager engines one after the other (forward hooks do not fire in CUDA-graph replays; an eager DDTree
engine redirects torch.ops.vllm.* process-wide while it lives), the tiny multimodal Qwen3.5 served
text-only (seed 3, as `vllm serve` case 9), one 1500-token prompt, 96 tokens. Forward hooks on the
decoder layers record, per target forward, each layer's token-mixer output and its output stream.
"""

from __future__ import annotations

import _engines as E
import pytest

PROMPT_LEN, THRESHOLD = 1500, 2e-2
LONG = {"max_model_len": 4096, "max_num_batched_tokens": 4096, "language_model_only": True,
        "skip_tokenizer_init": False}


class Recorder:
    """Forward hooks on one engine's decoder layers: per target forward, its positions and input ids,
    each layer's mixer output ("mixer") and output stream ("out": hidden + residual), float32 on the CPU."""

    def __init__(self, runner):
        import torch.nn as nn

        lists = [(n, m) for n, m in runner.model.named_modules() if isinstance(m, nn.ModuleList) and len(m)
                 and all("DecoderLayer" in type(x).__name__ for x in m)]
        _, self.layers = max(lists, key=lambda c: len(c[1]))
        self.runner, self.steps, self.handles = runner, [], []
        self.types = ["gdn" if hasattr(layer, "linear_attn") else "attention" for layer in self.layers]
        self.handles.append(self.layers[0].register_forward_pre_hook(self._start, with_kwargs=True))
        for i, layer in enumerate(self.layers):
            mixer = getattr(layer, "linear_attn", None) or layer.self_attn
            self.handles.append(layer.register_forward_hook(self._hook(i, "out")))
            self.handles.append(mixer.register_forward_hook(self._hook(i, "mixer"), with_kwargs=True))

    def _start(self, module, args, kwargs):
        hs = kwargs.get("hidden_states", args[0] if args else None)
        pos = kwargs.get("positions", args[2] if len(args) > 2 else None)
        n = int(hs.shape[0])
        pos = pos[0] if pos is not None and pos.dim() == 2 else pos  # M-RoPE (3, N): text rows repeat one
        ids = getattr(self.runner, "input_ids", None)
        ids = getattr(ids, "gpu", ids)  # V1 keeps the step's token ids in a CPU/GPU buffer pair
        self.steps.append({"n": n, "positions": pos[:n].tolist(), "ids": ids[:n].tolist() if ids is not None else None,
                           "layers": [{} for _ in self.layers]})

    def _hook(self, i, site):
        import torch

        def hook(module, *a):
            output = a[-1]
            if site == "out" and isinstance(output, (tuple, list)):  # (hidden, residual): the stream after it
                output = output[0] + output[1] if len(output) > 1 and output[1] is not None else output[0]
            elif site == "mixer":  # GDN mixers write into an output buffer (`output=` or their 2nd argument)
                args, kwargs = a[0], a[1]
                t = output[0] if isinstance(output, (tuple, list)) else output
                if not isinstance(t, torch.Tensor):
                    t = kwargs.get("output", args[1] if len(args) > 1 else None)
                output = t
            if self.steps and isinstance(output, torch.Tensor):
                self.steps[-1]["layers"][i][site] = output.detach().float().cpu()
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def _common_rows(a, b) -> int:
    """Rows from the first on where both forwards fed the same (position, token)."""
    m = min(a["n"], b["n"])
    ids = a["ids"] is not None and b["ids"] is not None
    return next((r for r in range(m) if a["positions"][r] != b["positions"][r] or (ids and a["ids"][r] != b["ids"][r])),
                m)


@pytest.fixture(scope="module")
def layer_diff(gpu_env, tmp_path_factory):
    gpu_env.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    from ddtree_compile.integration import engines, metrics
    from ddtree_compile.testing import models

    root = tmp_path_factory.mktemp("layer_diff")
    target = models.write_tiny_vl_model(root / "target", seed=3)
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash", seed=3)
    prompt = models.token_prompts(4, PROMPT_LEN, models.VOCAB - 8, seed=0)[0]  # no vision token ids
    out, recs = {}, {}
    for mode, kw in (("flat", {"flat": True}), ("ddtree", {"top_k": 1})):
        with E.running(target, drafter, graphs=False, **LONG, **kw) as (llm, info):
            out[f"{mode}_engine"] = info
            if mode == "ddtree":
                out["attached"] = engines.find_state(llm) is not None
                out["fallbacks_at_start"] = dict(metrics.PROCESS_STARTUP_FALLBACKS)
            recs[mode] = Recorder(engines.find_runner(llm))
            try:
                out[f"tokens_{mode}"] = E.generate(llm, [prompt])[0]["tokens"]
            finally:
                recs[mode].remove()
            if mode == "ddtree":
                out["counters"] = metrics.collect(llm)[0] if out["attached"] else {}
    out["types"] = recs["flat"].types
    out["steps"] = []
    for a, b in zip(recs["flat"].steps, recs["ddtree"].steps):
        rows = _common_rows(a, b)
        per_layer = []
        for la, lb in zip(a["layers"], b["layers"]):
            ent = {}
            for site in ("mixer", "out"):
                if site in la and site in lb and rows:
                    x, y = la[site][:rows].reshape(rows, -1), lb[site][:rows].reshape(rows, -1)
                    d = float((x - y).abs().max())
                    ent[site] = {"max_abs": d, "rel": d / max(float(x.abs().max()), 1e-30)}
            per_layer.append(ent)
        out["steps"].append({"n": [a["n"], b["n"]], "rows": rows, "layers": per_layer})
    return out


def test_verify_follows_vllm_arithmetic_layer_by_layer(layer_diff, record):
    steps, types = layer_diff["steps"], layer_diff["types"]
    first_attention = types.index("attention") if "attention" in types else len(types)
    worst = [max((s["layers"][i].get(site, {}).get("rel", 0.0) for s in steps), default=0.0)
             for i in range(len(types)) for site in ("mixer", "out")]
    gdn_max_abs = max((s["layers"][i][site]["max_abs"] for s in steps for i in range(first_attention)
                       for site in ("mixer", "out") if site in s["layers"][i]), default=None)
    record(layer_types=types, forwards=len(steps), worst_rel_per_layer_site=worst, gdn_max_abs=gdn_max_abs,
           tokens_equal=layer_diff["tokens_flat"] == layer_diff["tokens_ddtree"], rows=[s["rows"] for s in steps],
           tree_steps=layer_diff["counters"].get("tree_steps"), start_s=layer_diff["ddtree_engine"]["start_s"])
    assert layer_diff["attached"], layer_diff["fallbacks_at_start"]
    assert layer_diff["counters"]["tree_steps"] > 0, layer_diff["counters"]
    assert len(steps) > 1 and steps[1]["rows"] > 0, [s["rows"] for s in steps]  # verifies were compared
    assert gdn_max_abs == 0.0, f"GatedDeltaNet layers before the first attention layer differ: {gdn_max_abs}"
    assert max(worst) <= THRESHOLD, worst
    assert layer_diff["tokens_flat"] == layer_diff["tokens_ddtree"]
