"""Which target layer first differs between vLLM's flat DFlash and DDTree (top_k 1) on the same verify?

    cd /tmp && python /work/main/benchmarks/gpu_layer_diff_026.py --out $OUT/layer_diff.json

Issue 28 (benchmarks/results/INDEX.md, "Long context on the GPU"): on the H100 greedy DDTree with
top_k 1 (every tree a plain chain of L = 7 drafts: flat DFlash's drafts, accepted lengths and verify
batches) leaves the no-speculation reference on prompt 0 at token 72, flat DFlash only at 94. The
verify differs only in the target's kernels: DDTree's tree attention / tree conv1d / tree GatedDeltaNet
templates where flat DFlash runs vLLM's FlashAttention / causal_conv1d_update /
fused_sigmoid_gating_delta_rule_update. This script finds the first layer whose output differs
beyond bf16 rounding.

Two engines, one after the other in this process (in-process, V1 runner, enforce_eager: forward hooks
do not fire in CUDA-graph replays; one at a time because an eager DDTree engine redirects
torch.ops.vllm.* process-wide while it lives): (a) vLLM's flat DFlash with L speculative tokens, (b)
DDTree with budget 16, top_k 1, draft length L (asserted attached, with tree steps > 0). Same target
and drafter as `gpu_e2e_026.py --kinds qwen3_5_vl --model-seed 3 --prompt-len 1500` (the tiny
multimodal Qwen3.5 served text-only, bf16, mamba_ssm_cache_dtype float32, max_model_len and
max_num_batched_tokens 4096 for long prompts), one prompt of its random prompts (`--prompt`).

Per target forward (step 0 = the prefill, then one per verify) forward hooks on the target's decoder
layers record, as float32 on the CPU: each layer's token mixer output (self_attn / linear_attn), its
returned (hidden_states, residual) (Qwen3-Next layers return the MLP output and the residual stream
before it: their sum "out" is the stream after the layer), the final norm's output and the logits of
the verify rows (the target's LogitsProcessor), plus the forward's token count, positions and input ids.

Step i of flat is compared with step i of DDTree on the rows both fed the same (position, token) from
the first row on: per layer and site max |a-b| and max |a-b| / max |a| (rel), the first site in
forward order whose rel exceeds `--threshold`, the logits' max diff and per-row argmax agreement. The
JSON (`--out`) holds both engines' tokens, DDTree's counters, every compared step's summary and the
full per-layer profile of the steps up to the one that produced the first differing token + 2
(`--all-profiles`: every step; row_rel: per row, max |a-b| / max |a| of that row; used_rows: the rows whose
prediction flat committed, accepted drafts + the bonus)
(`profiles`), with `divergence` naming the token, the step that produced it and the step before it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
import traceback

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: hooks on the runner's model
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BUDGET, TOP_K, DRAFT_LEN = 16, 1, 7
LONG_MODEL_LEN = 4096  # gpu_e2e_026 / gpu_serve_026: max_model_len and batched tokens for long prompts
SITES = ("mixer", "residual", "hidden", "out")  # per layer, in forward order


# ---------------------------------------------------------------------------------------------
# models, prompts, engines (gpu_e2e_026's qwen3_5_vl path)
# ---------------------------------------------------------------------------------------------

def write_models(root: pathlib.Path, model_seed: int, n_prompts: int, prompt_len: int):
    from ddtree_compile.testing import models

    target = models.write_tiny_vl_model(root / "qwen3_5_vl", seed=model_seed)
    drafter = models.write_tiny_dflash_drafter(target, root / "qwen3_5_vl_dflash", seed=model_seed)
    prompts = models.token_prompts(n_prompts, prompt_len, models.VOCAB - 8, seed=0)  # no vision token ids
    return target, drafter, prompts


def engine_settings(prompt_len: int, max_tokens: int, max_model_len: int | None) -> dict:
    """gpu_e2e_026.engine_settings: max_model_len (and as many batched tokens) 4096 when needed."""
    need = prompt_len + max_tokens + 2 * max(BUDGET, DRAFT_LEN) + 64
    if max_model_len is None and need > 512:
        max_model_len = max(LONG_MODEL_LEN, -(-need // 256) * 256)
    return {} if max_model_len is None else {"max_model_len": max_model_len, "max_num_batched_tokens": max_model_len}


def start_engine(target, drafter, mode: str, engine_kw: dict, ssm_cache_dtype: str):
    """mode "flat": vLLM's flat DFlash with DRAFT_LEN speculative tokens; "ddtree": DDTree's switch."""
    from vllm import LLM

    from ddtree_compile.integration import config
    from ddtree_compile.testing import models

    kw = models.tiny_llm_kwargs(target, dtype="bfloat16", async_scheduling=False, enforce_eager=True,
                                language_model_only=True, skip_tokenizer_init=False, **engine_kw)
    if ssm_cache_dtype != "auto":
        kw["mamba_ssm_cache_dtype"] = ssm_cache_dtype
    extra = {"gdn_prefill_backend": "triton"}
    if mode == "flat":
        kw["speculative_config"] = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": DRAFT_LEN}
    else:
        switch = config.vllm_kwargs(drafter, budget=BUDGET, top_k=TOP_K, num_speculative_tokens=DRAFT_LEN)
        kw["speculative_config"] = switch["speculative_config"]
        kw["compilation_config"] = switch["compilation_config"]  # inert under enforce_eager (eager redirect)
        extra.update(switch["additional_config"])
    kw["additional_config"] = extra
    t0 = time.perf_counter()
    llm = LLM(**kw)
    return llm, time.perf_counter() - t0, {k: v for k, v in kw.items() if k != "model"}


# ---------------------------------------------------------------------------------------------
# recording
# ---------------------------------------------------------------------------------------------

def find_decoder_layers(model):
    """(dotted name, ModuleList, parent) of the target's decoder layers: the longest ModuleList whose
    children are all *DecoderLayer modules (else the longest ModuleList named "...layers")."""
    import torch.nn as nn

    cands = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    pick = [c for c in cands if all("DecoderLayer" in type(x).__name__ for x in c[1])]
    pick = pick or [c for c in cands if c[0].split(".")[-1] == "layers"]
    if not pick:
        raise RuntimeError("no decoder-layer ModuleList found in the target model")
    name, layers = max(pick, key=lambda c: len(c[1]))
    parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    return name, layers, parent


def layer_types(runner, layers) -> list[str]:
    """Per layer "full_attention" / "linear_attention": the HF text config's layer_types, else the layer."""
    hf = runner.vllm_config.model_config.hf_config
    text = getattr(hf, "text_config", None) or hf
    types = list(getattr(text, "layer_types", None) or [])
    if len(types) != len(layers):
        types = [getattr(l, "layer_type", None) or ("linear_attention" if hasattr(l, "linear_attn")
                                                    else "full_attention") for l in layers]
    return types


def _first_tensor(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for y in x:
            if isinstance(y, torch.Tensor):
                return y
    return None


def _cpu(t):
    return None if t is None else t.detach().float().cpu().clone()


class Recorder:
    """Forward hooks on one engine's target: one record per target forward while `active`."""

    def __init__(self, runner, max_verify_steps: int | None):
        self.runner = runner
        model = runner.model
        self.layers_name, self.layers, parent = find_decoder_layers(model)
        self.types = layer_types(runner, self.layers)
        self.norm = getattr(parent, "norm", None)
        lps = [m for _, m in model.named_modules() if type(m).__name__ == "LogitsProcessor"]
        self.logits_proc = lps[0] if lps else None
        self.max_verify = max_verify_steps
        self.steps: list[dict] = []
        self.cur: dict | None = None
        self.active = False
        self.handles = []
        self.mixer_names = []

    # hooks -------------------------------------------------------------------------------------
    def install(self) -> "Recorder":
        self.handles.append(self.layers[0].register_forward_pre_hook(self._start, with_kwargs=True))
        for i, layer in enumerate(self.layers):
            self.handles.append(layer.register_forward_hook(self._layer_hook(i)))
            t = self.types[i]
            mixer_attr = "linear_attn" if t == "linear_attention" else "self_attn"
            mixer = getattr(layer, mixer_attr, None)
            if mixer is None:
                mixer_attr = next((a for a in ("linear_attn", "self_attn", "attn", "mixer") if hasattr(layer, a)), None)
                mixer = getattr(layer, mixer_attr) if mixer_attr else None
            self.mixer_names.append(mixer_attr)
            if mixer is not None:
                self.handles.append(mixer.register_forward_hook(self._mixer_hook(i), with_kwargs=True))
        if self.norm is not None:
            self.handles.append(self.norm.register_forward_hook(self._norm_hook))
        if self.logits_proc is not None:
            self.handles.append(self.logits_proc.register_forward_hook(self._logits_hook))
        return self

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _input_ids(self, n: int):
        buf = getattr(self.runner, "input_ids", None)
        buf = getattr(buf, "gpu", buf)
        try:
            return buf[:n].detach().cpu().tolist()
        except Exception:
            return None

    def _start(self, module, args, kwargs):
        self.cur = None
        if not self.active:
            return
        n_verify = sum(1 for s in self.steps if s["kind"] == "verify")
        kind = "prefill" if not self.steps else "verify"
        if kind == "verify" and self.max_verify is not None and n_verify >= self.max_verify:
            return
        hs = kwargs.get("hidden_states", args[0] if args else None)
        pos = kwargs.get("positions", args[2] if len(args) > 2 else None)
        n = int(hs.shape[0])
        if pos is not None and pos.dim() == 2:  # M-RoPE (3, N): text-only rows carry one position thrice
            pos = pos[0]
        self.cur = {"kind": kind, "n_tokens": n,
                    "positions": pos[:n].detach().cpu().tolist() if pos is not None else None,
                    "input_ids": self._input_ids(n),
                    "layers": [{} for _ in self.layers], "final_norm": None, "logits": None}
        self.steps.append(self.cur)

    def _layer_hook(self, i):
        def hook(module, args, output):
            if self.cur is None:
                return
            rec = self.cur["layers"][i]
            if isinstance(output, (tuple, list)):
                rec["hidden"], rec["residual"] = _cpu(output[0]), _cpu(output[1]) if len(output) > 1 else None
            else:
                rec["hidden"], rec["residual"] = _cpu(output), None
        return hook

    def _mixer_hook(self, i):
        def hook(module, args, kwargs, output):
            if self.cur is None:
                return
            t = _first_tensor(output)
            if t is None:  # layers that hand the mixer an output buffer (`output=`, or the second argument)
                t = _first_tensor(kwargs.get("output"))
                if t is None and len(args) > 1:
                    t = _first_tensor(args[1])
            self.cur["layers"][i]["mixer"] = _cpu(t)
        return hook

    def _norm_hook(self, module, args, output):
        if self.cur is not None and self.cur["final_norm"] is None:
            self.cur["final_norm"] = _cpu(_first_tensor(output))

    def _logits_hook(self, module, args, output):
        if self.cur is not None and self.cur["logits"] is None:
            self.cur["logits"] = _cpu(_first_tensor(output))


def record(llm, prompt: dict, max_tokens: int, max_verify: int | None):
    from ddtree_compile.integration import engines
    from ddtree_compile.testing import harness

    runner = engines.find_runner(llm)
    if runner is None:
        raise RuntimeError("no in-process model runner (VLLM_ENABLE_V1_MULTIPROCESSING must be 0)")
    rec = Recorder(runner, max_verify).install()
    rec.active = True
    try:
        t0 = time.perf_counter()
        tokens = harness.generate(llm, [prompt], max_tokens)[0]
        gen_s = time.perf_counter() - t0
    finally:
        rec.active = False
        rec.remove()
    return rec, tokens, gen_s


# ---------------------------------------------------------------------------------------------
# comparison
# ---------------------------------------------------------------------------------------------

def _site(layer_rec: dict, site: str):
    if site == "out":
        h, r = layer_rec.get("hidden"), layer_rec.get("residual")
        return None if h is None or r is None else h + r
    return layer_rec.get(site)


def _diff(a, b, rows: int, threshold: float) -> dict | None:
    if a is None or b is None or rows <= 0:
        return None
    x, y = a[:rows].reshape(rows, -1), b[:rows].reshape(rows, -1)
    d = (x - y).abs()
    scale = float(x.abs().max())
    row_rel = (d.max(-1).values / x.abs().max(-1).values.clamp_min(1e-30)).tolist()
    over = [r for r, v in enumerate(row_rel) if v > threshold]
    return {"max_abs": float(d.max()), "rel": float(d.max()) / max(scale, 1e-30), "scale": scale,
            "row_rel": [round(v, 6) for v in row_rel], "first_row_over": over[0] if over else None}


def _common_rows(a: dict, b: dict) -> int:
    """Rows from the first on where both forwards fed the same (position, token)."""
    m = min(a["n_tokens"], b["n_tokens"])
    for r in range(m):
        if a["positions"] is not None and b["positions"] is not None and a["positions"][r] != b["positions"][r]:
            return r
        if a["input_ids"] is not None and b["input_ids"] is not None and a["input_ids"][r] != b["input_ids"][r]:
            return r
    return m


def compare_step(i: int, a: dict, b: dict, types: list[str], threshold: float) -> dict:
    rows = _common_rows(a, b)
    out = {"step": i, "kind": a["kind"], "n_tokens": [a["n_tokens"], b["n_tokens"]],
           "equal_token_counts": a["n_tokens"] == b["n_tokens"],
           "start_position": [a["positions"][0] if a["positions"] else None,
                              b["positions"][0] if b["positions"] else None],
           "input_ids": [a["input_ids"] if a["kind"] == "verify" else None,
                         b["input_ids"] if b["kind"] == "verify" else None],
           "rows_compared": rows, "layers": [], "first_over": None}
    for li, (la, lb) in enumerate(zip(a["layers"], b["layers"])):
        ent = {"layer": li, "type": types[li]}
        for site in SITES:
            ent[site] = _diff(_site(la, site), _site(lb, site), rows, threshold)
            if out["first_over"] is None and ent[site] is not None and ent[site]["rel"] > threshold:
                out["first_over"] = {"layer": li, "type": types[li], "site": site, "rel": ent[site]["rel"],
                                     "row": ent[site]["first_row_over"]}
        out["layers"].append(ent)
    out["final_norm"] = _diff(a["final_norm"], b["final_norm"], rows, threshold)
    if out["first_over"] is None and out["final_norm"] is not None and out["final_norm"]["rel"] > threshold:
        out["first_over"] = {"layer": None, "type": "final_norm", "site": "final_norm",
                             "rel": out["final_norm"]["rel"], "row": out["final_norm"]["first_row_over"]}
    la, lb = a["logits"], b["logits"]
    if la is not None and lb is not None:
        # logits rows are the verify rows (prefill: its last row); compare the rows both have
        r = min(la.shape[0], lb.shape[0], rows if a["kind"] == "verify" else la.shape[0])
        out["logits"] = _diff(la, lb, r, threshold)
        if r:
            top2 = la[:r].float().topk(2, dim=-1)
            out["logits"]["rows"] = r
            out["logits"]["n_rows"] = [int(la.shape[0]), int(lb.shape[0])]
            out["logits"]["argmax"] = [la[:r].argmax(-1).tolist(), lb[:r].argmax(-1).tolist()]
            out["logits"]["argmax_equal"] = (la[:r].argmax(-1) == lb[:r].argmax(-1)).tolist()
            out["logits"]["flat_top2_gap"] = [round(v, 5) for v in (top2.values[:, 0] - top2.values[:, 1]).tolist()]
    else:
        out["logits"] = None
    return out


def divergence_step(steps: list[dict], prompt_len: int, d: int | None) -> int | None:
    """Index of the forward that produced generated token d (0: the prefill): the last forward whose
    first position is at most prompt_len + d - 1 (the row that predicts token d)."""
    if d is None:
        return None
    if d == 0:
        return 0
    p = prompt_len + d - 1
    best = None
    for i, s in enumerate(steps):
        if s["positions"] and s["positions"][0] <= p:
            best = i
    return best


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def print_table(result: dict) -> None:
    types = result["layer_types"]
    short = ["A" if t == "full_attention" else "G" for t in types]
    print(f"\nper step: rel diff (max|a-b| / max|a|) of each layer's output stream (hidden + residual), "
          f"layers {''.join(short)} (A attention, G GatedDeltaNet); first site over {result['threshold']}")
    print(f"{'step':>4} {'kind':<7} {'tok f/d':>8} {'pos':>6} {'rows':>4} {'used':>4} "
          + " ".join(f"{'L' + str(i) + short[i]:>7}" for i in range(len(types)))
          + f" {'logits':>7} {'argmax=':>7}  first over")
    for s in result["steps"]:
        outs = [_fmt(l["out"]["rel"]) if l.get("out") else "-" for l in s["layers"]]
        lg = s.get("logits") or {}
        eq = lg.get("argmax_equal")
        fo = s["first_over"]
        fo_s = "-" if fo is None else f"L{fo['layer']} {fo['type']} {fo['site']} rel {fo['rel']:.2e} row {fo['row']}"
        mark = " <= divergence" if s["step"] == result["divergence"].get("step") else ""
        print(f"{s['step']:>4} {s['kind']:<7} {s['n_tokens'][0]:>3}/{s['n_tokens'][1]:<4} "
              f"{s['start_position'][0]!s:>6} "
              f"{s['rows_compared']:>4} {s.get('used_rows')!s:>4} " + " ".join(f"{o:>7}" for o in outs)
              + f" {_fmt(lg.get('max_abs')):>7} {('-' if eq is None else f'{sum(eq)}/{len(eq)}'):>7}  {fo_s}{mark}")
    for key in ("before", "at"):
        i = result["divergence"].get(f"step_{key}" if key == "before" else "step")
        prof = next((s for s in result["steps"] if s["step"] == i), None)
        if prof is None:
            continue
        print(f"\nprofile of step {i} ({'the step before the divergence' if key == 'before' else 'the divergence step'}"
              f", {prof['rows_compared']} rows): max_abs / rel per site")
        for l in prof["layers"]:
            cells = [f"{site} {_fmt(l[site]['max_abs'])}/{_fmt(l[site]['rel'])}" if l.get(site) else f"{site} -"
                     for site in SITES]
            print(f"  L{l['layer']} {l['type']:<16} " + "  ".join(cells))
        for k in ("final_norm", "logits"):
            if prof.get(k):
                extra = ""
                if k == "logits" and "argmax_equal" in prof[k]:
                    extra = f"  argmax equal {prof[k]['argmax_equal']}  flat top-2 gap {prof[k]['flat_top2_gap']}"
                print(f"  {k:<19} max_abs {_fmt(prof[k]['max_abs'])} rel {_fmt(prof[k]['rel'])}{extra}")


# ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    global BUDGET, TOP_K, DRAFT_LEN
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=4, help="random prompts generated (as gpu_e2e_026)")
    ap.add_argument("--prompt", type=int, default=0, help="which of them to run")
    ap.add_argument("--prompt-len", type=int, default=1500)
    ap.add_argument("--model-seed", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--budget", type=int, default=BUDGET)
    ap.add_argument("--top-k", type=int, default=TOP_K)
    ap.add_argument("--draft-len", type=int, default=DRAFT_LEN)
    ap.add_argument("--ssm-cache-dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None,
                    help="record only the first N verify forwards (default: all of max-tokens; the JSON's "
                         "profiles cover the steps up to the divergence + 2)")
    ap.add_argument("--threshold", type=float, default=2e-2, help="rel diff counted as beyond bf16 rounding")
    ap.add_argument("--all-profiles", action="store_true", help="full per-layer profile of every step in the JSON")
    args = ap.parse_args(argv)
    BUDGET, TOP_K, DRAFT_LEN = args.budget, args.top_k, args.draft_len

    import torch
    import vllm

    from ddtree_compile.integration import engines, metrics, plugin
    from ddtree_compile.testing import harness

    plugin.register()
    engine_kw = engine_settings(args.prompt_len, args.max_tokens, args.max_model_len)
    result = {"command": " ".join(sys.argv), "vllm": vllm.__version__, "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "budget": BUDGET, "top_k": TOP_K, "draft_len": DRAFT_LEN, "model_seed": args.model_seed,
              "prompt": args.prompt, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
              "mamba_ssm_cache_dtype": args.ssm_cache_dtype, "engine_kw": engine_kw, "threshold": args.threshold,
              "enforce_eager": True, "ok": False}
    recs, tokens = {}, {}
    t_all = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            target, drafter, prompts = write_models(pathlib.Path(tmp), args.model_seed, args.prompts, args.prompt_len)
            prompt = prompts[args.prompt]
            for mode in ("flat", "ddtree"):
                llm, start_s, kw = start_engine(target, drafter, mode, engine_kw, args.ssm_cache_dtype)
                result[f"start_s_{mode}"] = start_s
                result[f"engine_{mode}"] = {k: v for k, v in kw.items() if k != "compilation_config"}
                try:
                    state = engines.find_state(llm)
                    if mode == "ddtree":
                        result["attached"] = state is not None
                        result["fallbacks_at_start"] = dict(metrics.PROCESS_STARTUP_FALLBACKS)
                        why = dict(metrics.PROCESS_STARTUP_FALLBACKS)
                        assert state is not None, f"DDTree did not attach (flat DFlash: no comparison): {why}"
                        before = metrics.collect(llm)[0]
                    else:
                        assert state is None, "the flat engine has a DDTree round attached"
                    rec, tokens[mode], result[f"generate_s_{mode}"] = record(llm, prompt, args.max_tokens, args.steps)
                    recs[mode] = rec
                    if mode == "ddtree":
                        c = metrics.counters_delta(metrics.collect(llm)[0], before)
                        result["ddtree_counters"] = c
                        assert c.get("tree_steps", 0) > 0, f"DDTree ran no tree steps: {c}"
                finally:
                    engines.shutdown(llm)
                    del llm
        result["layers_module"] = recs["flat"].layers_name
        result["layer_types"] = recs["flat"].types
        result["mixer_modules"] = recs["flat"].mixer_names
        result["hooks"] = {m: {"final_norm": r.norm is not None, "logits_processor": r.logits_proc is not None}
                           for m, r in recs.items()}
        result["tokens_flat"], result["tokens_ddtree"] = tokens["flat"], tokens["ddtree"]
        d = harness.first_divergence(tokens["flat"], tokens["ddtree"])
        sa, sb = recs["flat"].steps, recs["ddtree"].steps
        result["forwards"] = {"flat": len(sa), "ddtree": len(sb)}
        result["token_counts"] = {"flat": [s["n_tokens"] for s in sa], "ddtree": [s["n_tokens"] for s in sb]}
        n = min(len(sa), len(sb))
        result["unequal_token_count_steps"] = [i for i in range(n) if sa[i]["n_tokens"] != sb[i]["n_tokens"]]
        result["mismatched_input_steps"] = [i for i in range(1, n) if _common_rows(sa[i], sb[i])
                                            < min(sa[i]["n_tokens"], sb[i]["n_tokens"])]
        ds = divergence_step(sa, len(prompt["prompt_token_ids"]), d)
        at = {m: tokens[m][d] if d is not None and d < len(tokens[m]) else None for m in ("flat", "ddtree")}
        result["divergence"] = {"token": d, "step": ds, "step_before": None if ds in (None, 0) else ds - 1,
                                "flat_token": at["flat"], "ddtree_token": at["ddtree"]}
        steps = [compare_step(i, sa[i], sb[i], result["layer_types"], args.threshold) for i in range(n)]
        over = [s["step"] for s in steps if s["first_over"] is not None]
        result["first_step_over"] = over[0] if over else None
        result["first_over_at_first_step"] = steps[over[0]]["first_over"] if over else None
        for i, s in enumerate(steps):  # rows whose prediction flat committed (accepted drafts + the bonus)
            nxt = sa[i + 1]["positions"][0] if i + 1 < len(sa) and sa[i + 1]["positions"] else None
            cur = sa[i]["positions"][-1] + 1 if s["kind"] == "prefill" else sa[i]["positions"][0]
            s["used_rows"] = None if nxt is None else (1 if s["kind"] == "prefill" else nxt - cur)
        amx = [s["step"] for s in steps if s.get("logits") and not all(s["logits"].get("argmax_equal", [True]))]
        result["first_argmax_diff_step"] = amx[0] if amx else None
        amx = [s["step"] for s in steps if s.get("logits") and s["used_rows"] is not None and s["kind"] == "verify"
               and not all(s["logits"].get("argmax_equal", [True])[:s["used_rows"]])]
        result["first_used_argmax_diff_step"] = amx[0] if amx else None
        result["prefill_identical"] = bool(steps and steps[0]["first_over"] is None and all(
            l[site] is None or l[site]["max_abs"] == 0 for l in steps[0]["layers"] for site in SITES))
        keep = n if (args.all_profiles or ds is None) else min(n, ds + 3)
        result["profiles"] = steps[:keep]
        result["steps"] = [{k: v for k, v in s.items() if k not in ("layers", "input_ids")}
                           | {"layers": [{"layer": l["layer"], "type": l["type"],
                                          **{site: ({"max_abs": l[site]["max_abs"], "rel": l[site]["rel"]}
                                                    if l[site] else None) for site in SITES}} for l in s["layers"]]}
                           for s in steps]
        for s in result["steps"]:
            if s.get("logits"):
                s["logits"] = {k: v for k, v in s["logits"].items() if k not in ("row_rel",)}
            if s.get("final_norm"):
                s["final_norm"] = {k: v for k, v in s["final_norm"].items() if k not in ("row_rel",)}
        result["ok"] = True
    except Exception as e:
        result["error"] = repr(e)
        result["traceback"] = traceback.format_exc()[-4000:]
        print(traceback.format_exc()[-4000:], file=sys.stderr)
    result["total_s"] = time.perf_counter() - t_all
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    if result["ok"]:
        print_table(result)
        dv = result["divergence"]
        print(f"\nprompt {args.prompt} ({args.prompt_len} tokens), {args.max_tokens} tokens: flat vs DDTree first "
              f"differ "
              f"at token {dv['token']} ({dv['flat_token']} vs {dv['ddtree_token']}), produced by step {dv['step']}; "
              f"first step over {args.threshold}: {result['first_step_over']} "
              f"({result['first_over_at_first_step']}); first logits argmax difference: step "
              f"{result['first_argmax_diff_step']} (on a row flat committed: step "
              f"{result['first_used_argmax_diff_step']}); "
              f"prefill identical: {result['prefill_identical']}")
        print(f"forwards flat/ddtree {result['forwards']['flat']}/{result['forwards']['ddtree']}, steps with unequal "
              f"token counts {result['unequal_token_count_steps'][:10]}, steps with different inputs "
              f"{result['mismatched_input_steps'][:10]}; DDTree tree steps "
              f"{result['ddtree_counters'].get('tree_steps')}, "
              f"chain steps {result['ddtree_counters'].get('chain_steps')}, fallbacks "
              f"{result['ddtree_counters'].get('fallback_total')}; total {result['total_s']:.0f} s")
    print(f"wrote {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
