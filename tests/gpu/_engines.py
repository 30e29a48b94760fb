"""Engine set-up and the lossless checks that the GPU modules share (tests/gpu).

Every engine is a tiny model written here with seeded random weights (ddtree_compile/testing/models.py),
bf16 (the Triton tree attention has no fp32 path), in-process (counters, commit hooks and the drafter
harness reach the runner). Compiled engines use the tree pass's compilation config with
FULL_AND_PIECEWISE CUDA graphs: tree verifies replay FULL graphs captured with the tree ops, mixed
batches run PIECEWISE. References (no speculation) run eagerly: their start costs seconds instead of a
compile, and the regret gate judges DDTree's divergences from them (an eager reference held every gate
of the V2 runs: tests/gpu/test_v2.py, benchmarks/results/gpu_suite.json).

Hybrids keep their GDN state cache in float32 in every engine: with bf16, no speculation rounds the
state after every token while a verify that accepts k tokens rounds once after k, and that alone moved
a first divergence past the gate, DDTree's plain chain (top_k 1) as much as its trees
(benchmarks/results/gpu_vllm026_h100.json, "probes"). Nothing here imports vLLM at module level: CI
collects the GPU modules on CPU machines and skips them.
"""

from __future__ import annotations

import contextlib
import re
import time

BUDGET, TOP_K, DRAFT_LEN, MAX_TOKENS, TOL = 16, 4, 7, 96, 0.2
MIXED = ["sliding_attention", "full_attention"]  # the Qwen3.6 drafter's shape: vLLM serves it on V2 only
# The multimodal target's settings: images need the tokenizer and a longer context than the tiny 512
MM = {"skip_tokenizer_init": False, "max_model_len": 1024, "limit_mm_per_prompt": {"image": 1}}
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


SERVE_NEEDS = ("openai", "httpx", "uvicorn", "fastapi", "watchfiles", "uvloop", "model_hosting_container_standards")


def require_server_modules() -> None:
    """Skips the calling test where vLLM's OpenAI server cannot start: modules the default GPU bundle
    lacks (docs/serve.md, "On the GPU": the bundle's extras)."""
    import importlib.util

    import pytest

    missing = [m for m in SERVE_NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"vLLM's OpenAI server needs {missing} (docs/serve.md, 'On the GPU': the bundle's extras)")


def memory_args() -> list[str]:
    """`vllm serve` flags of the GPU-share the suite set (run_suite --per-gpu; models.tiny_llm_kwargs
    reads the same variable for in-process engines): vLLM refuses to start when the free memory is
    below gpu_memory_utilization x total (`v1/worker/utils.py:425-443`), which another module's
    engines on the same GPU would make it; the KV caches here are fixed in bytes either way."""
    import os

    share = os.environ.get("DDTREE_GPU_MEMORY_UTILIZATION")
    return ["--gpu-memory-utilization", share] if share else []


def engine_kwargs(target, drafter=None, *, flat=False, hybrid=True, graphs=True, budget=BUDGET, top_k=TOP_K,
                  auto_menu=None, async_scheduling=False, **kw) -> dict:
    """`vllm.LLM`'s kwargs for one engine: no speculation (drafter None), vLLM's flat DFlash (flat) or
    DDTree; async_scheduling None: as vLLM resolves it (on for DFlash: the default loop). With
    $DDTREE_GPU_OP_SWAP=trace DDTree engines take op_swap "trace" and every engine vLLM's own split with
    the mirrors in it (passes/entry.traced_compilation_config); by default the tree-verify pass's config.
    With $DDTREE_GPU_DDTREE_EAGER=1 (`ddtree_eager`) DDTree engines run eagerly, the references as they are."""
    import os

    from ddtree_compile.integration import config
    from ddtree_compile.passes.entry import compilation_config, traced_compilation_config
    from ddtree_compile.testing import models

    op_swap = os.environ.get("DDTREE_GPU_OP_SWAP", "pass")
    if drafter is not None and not flat and ddtree_eager():
        graphs = False

    args = models.tiny_llm_kwargs(target, dtype="bfloat16", **kw)
    if async_scheduling is not None:
        args["async_scheduling"] = async_scheduling
    if hybrid:
        args.setdefault("mamba_ssm_cache_dtype", "float32")
    extra = {"gdn_prefill_backend": "triton"} if hybrid else {}  # the GPU bundle has no FlashInfer
    if graphs:
        cc = compilation_config("cuda") if op_swap == "pass" else traced_compilation_config("cuda")
        args["compilation_config"] = {**cc, "cudagraph_mode": "FULL_AND_PIECEWISE"}
    else:
        args["enforce_eager"] = True
    if flat:  # vLLM's own flat DFlash: the control for what speculation alone changes
        args["speculative_config"] = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": DRAFT_LEN}
    elif drafter is not None:
        auto = {"auto_budget": auto_menu, "probe_interval": 4} if auto_menu else {}
        switch = config.vllm_kwargs(drafter, budget="auto" if auto_menu else budget, top_k=top_k,
                                    num_speculative_tokens=DRAFT_LEN, op_swap=op_swap, **auto)
        args["speculative_config"] = switch["speculative_config"]
        extra.update(switch["additional_config"])
    if extra:
        args["additional_config"] = extra
    return args


def ddtree_eager() -> bool:
    """$DDTREE_GPU_DDTREE_EAGER=1: a bisection switch. DDTree engines run eagerly (vLLM's ops pointed at the
    same mirrors and templates, no compile, no CUDA graphs) next to the usual references, so a gate that a
    compiled DDTree engine misses tells whether its compile moved it; the tests' graph checks are skipped."""
    import os

    return os.environ.get("DDTREE_GPU_DDTREE_EAGER") == "1"


@contextlib.contextmanager
def running(target, drafter=None, **kw):
    """(llm, info) of one engine (engine_kwargs' settings), shut down (its GPU memory freed) however the
    block ends (e2e.engine). info: its start time, runner, CUDA-graph mode, loop and M-RoPE."""
    from ddtree_compile.integration import engines
    from ddtree_compile.testing import e2e

    args = engine_kwargs(target, drafter, **kw)
    t0 = time.perf_counter()
    with e2e.engine(**args) as llm:
        info = {"start_s": round(time.perf_counter() - t0, 1)}
        runner = engines.find_runner(llm)
        if runner is not None:
            vc = runner.vllm_config
            info.update(runner=f"{type(runner).__module__}.{type(runner).__name__}",
                        cudagraph_mode=str(vc.compilation_config.cudagraph_mode),
                        async_scheduling=bool(vc.scheduler_config.async_scheduling),
                        uses_mrope=bool(vc.model_config.uses_mrope))
        yield llm, info


def generate(llm, prompts, logprobs=None, max_tokens=MAX_TOKENS, **sampling) -> list[dict]:
    """e2e.complete at the suite's length: per prompt (token ids or text + image) a Completion {prompt,
    tokens, lps, cached}, greedy unless `sampling` says otherwise."""
    from ddtree_compile.testing import e2e

    return e2e.complete(llm, prompts, max_tokens, logprobs, **sampling)


def gates(ref: list[dict], got: list[dict]) -> list[dict]:
    """e2e.gates at the suite's tolerance: each output against the reference's (generate(..., logprobs=5))."""
    from ddtree_compile.testing import e2e

    return e2e.gates(ref, got, TOL)


def reference(target, prompts: dict, graphs: bool = False, score: bool | dict = False, **kw) -> tuple[dict, dict]:
    """(engine info, {prompt kind: greedy outputs with log-probs}) of a no-speculation engine: eager, or
    with graphs compiled as the suite's engines are (engine_kwargs). score (token prompts only): True, or
    outputs of the same prompt kinds, whose every position this engine also scores teacher-forced
    (`forced_top`; True: its own outputs) into info["forced"]."""
    with running(target, graphs=graphs, **kw) as (llm, info):
        outs = {k: generate(llm, p, logprobs=5) for k, p in prompts.items()}
        if score:
            try:  # a record only: a vLLM that refuses prompt_logprobs here leaves the reference as it was
                info["forced"] = {k: forced_top(llm, (outs if score is True else score)[k]) for k in prompts}
            except Exception as e:  # noqa: BLE001
                info["forced_error"] = repr(e)[:300]
        return info, outs


def at_divergences(report: list[dict], eager: dict, compiled: dict) -> list[dict | None]:
    """Per prompt where an output left the reference (e2e.gates' report): both no-speculation engines' top
    2 at that position given the reference's prefix (`reference`'s info["forced"]: the eager engine's and
    the compiled one's, teacher-forced), to tell a verify's error from the compiled target's numerics."""
    def top(row):
        return [[t, round(lp, 4)] for t, lp in row.items()]

    if eager is None or compiled is None:
        return []
    return [None if g["divergence"] is None else
            {"at": g["divergence"], "got": g.get("got"), "want": g.get("want"),
             "eager_forced": top(eager[i][g["divergence"]]), "compiled_forced": top(compiled[i][g["divergence"]])}
            for i, g in enumerate(report)]


def forced_top(llm, outputs: list[dict], top: int = 2) -> list[list[dict]]:
    """Per output (prompt, tokens), per generated position i: the engine's top `top` {token: logprob} at i
    given the prompt and tokens[:i] (vLLM's prompt_logprobs of prompt + tokens: one forward over the whole
    sequence, as a verify is, teacher-forced)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=top)
    outs = llm.generate([{"prompt_token_ids": r["prompt"] + r["tokens"]} for r in outputs], params, use_tqdm=False)
    got = []
    for r, o in zip(outputs, outs):
        n = len(r["prompt"])
        rows = o.prompt_logprobs[n:]
        got.append([dict(sorted(((t, lp.logprob) for t, lp in pos.items()), key=lambda x: -x[1])[:top])
                    for pos in rows])
    return got


def text_and_image_prompts() -> dict:
    """4 random-token prompts (no vision token ids) and 4 image prompts of different sizes."""
    import numpy as np
    from PIL import Image

    from ddtree_compile.testing import models

    def image(seed, size=128):
        return Image.fromarray((np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8"))

    return {"text": models.token_prompts(4, 16, models.VOCAB - 8, seed=5),
            "image": [{"prompt": IMAGE + "what is this", "multi_modal_data": {"image": image(0)}},
                      {"prompt": "look " + IMAGE + "and say", "multi_modal_data": {"image": image(1)}},
                      {"prompt": "two " + IMAGE + "then", "multi_modal_data": {"image": image(2, 192)}},
                      {"prompt": IMAGE, "multi_modal_data": {"image": image(3, 64)}}]}


def seeded(llm, prompts: list) -> dict:
    """Seeded sampling (temperature 1): the batch twice with one seed, once with another, and requests
    1-3 alone: reproducible, independent of the batch, and the seed matters."""
    one = [g["tokens"] for g in generate(llm, prompts, temperature=1.0, seed=1234)]
    again = [g["tokens"] for g in generate(llm, prompts, temperature=1.0, seed=1234)]
    other = [g["tokens"] for g in generate(llm, prompts, temperature=1.0, seed=4321)]
    alone = [generate(llm, [q], temperature=1.0, seed=1234)[0]["tokens"] for q in prompts[1:4]]
    return {"seeded_repeat_equal": one == again, "seeded_alone_equal": alone == one[1:4],
            "seeded_seeds_differ": one != other}


@contextlib.contextmanager
def drafting_from(llm, continuation: dict, check=None):
    """For the block: the drafter harness drafting `continuation` ({prompt ids: prompt + continuation}:
    deep accepts and sibling branches), and with `check` (a harness.GdnStateCheck) every commit checked."""
    from ddtree_compile.integration import engines
    from ddtree_compile.testing import harness

    state = engines.find_state(llm)
    if check is not None:
        state.debug_gdn_records = True
        state.commit_hooks.append(check)
    h = harness.DraftHarness(continuation).install(llm)
    try:
        yield
    finally:
        h.uninstall()
        if check is not None:
            state.commit_hooks.remove(check)
            state.debug_gdn_records = False


def ddtree_runs(llm, ref: dict, prompts: dict, state_check: bool, control: dict | None = None) -> dict:
    """DDTree's checks on one engine, per prompt kind: its own random drafter, then the drafter harness
    (drafts from the reference's continuation: deep accepts and sibling branches) with, on hybrids,
    every committed GDN state and conv window checked against a float32 replay of the path; then
    seeded sampling. Counters per phase (tree_steps, graph_steps = verifies that replayed a FULL graph).
    control: a second reference (as `ref`); each output's gates against it too, as numbers to record."""
    from ddtree_compile.integration import engines, metrics
    from ddtree_compile.testing import harness

    state = engines.find_state(llm)
    out = {"attached": state is not None, "fallbacks_at_start": dict(metrics.PROCESS_STARTUP_FALLBACKS)}
    if state is None:
        return out
    check = harness.GdnStateCheck()
    continuation = {tuple(r["prompt"]): r["prompt"] + r["tokens"] for v in ref.values() for r in v}
    for kind, p in prompts.items():
        c0 = metrics.collect(llm)[0]
        got = generate(llm, p)
        c1 = metrics.collect(llm)[0]
        with drafting_from(llm, continuation, check if state_check else None):
            guided = generate(llm, p)
        c2 = metrics.collect(llm)[0]
        out[kind] = {"gates_random": gates(ref[kind], got), "gates_harness": gates(ref[kind], guided),
                     "counters_random": metrics.counters_delta(c1, c0),
                     "counters_harness": metrics.counters_delta(c2, c1)}
        if control is not None:
            out[kind].update(control_random=gates(control[kind], got), control_harness=gates(control[kind], guided))
    if state_check:
        out["state_check"] = {"paths": check.paths, "sibling_paths": check.sibling_paths,
                              "boundaries": check.boundaries, "max_rel_err": check.max_err}
    out.update(seeded(llm, [q for v in prompts.values() for q in v]))
    out["counters_total"] = metrics.collect(llm)[0]
    return out


def check_lossless(out: dict, kinds, graphs: bool = True, state_check: bool = True, record=None) -> None:
    """The assertions on ddtree_runs' result (and its key numbers to `record`)."""
    assert out["attached"], f"DDTree did not attach: {out['fallbacks_at_start']}"
    all_gates = [g for k in kinds for key in ("gates_random", "gates_harness") for g in out[k][key]]
    if record is not None:
        record(gates_ok=f"{sum(g['ok'] for g in all_gates)}/{len(all_gates)}",
               max_regret=max(g["regret"] for g in all_gates),
               first_divergences=[g["divergence"] for g in all_gates],
               **{f"{k}_{phase}": {c: out[k][f"counters_{phase}"].get(c) for c in
                                   ("tree_steps", "graph_steps", "sibling_rounds", "mean_accept_depth")}
                  for k in kinds for phase in ("random", "harness")},
               state_check=out.get("state_check"),
               seeded={k: out[k] for k in ("seeded_repeat_equal", "seeded_alone_equal", "seeded_seeds_differ")})
    from ddtree_compile.testing import e2e

    for k in kinds:
        for phase in ("random", "harness"):
            c = out[k][f"counters_{phase}"]
            assert c["tree_steps"] > 0, (k, phase, c)
            if graphs:  # every tree verify replayed a FULL graph (captured with the tree ops)
                assert c["graph_steps"] >= c["tree_steps"], (k, phase, c)
        assert out[k]["counters_harness"]["sibling_rounds"] > 0, out[k]  # the trees left the top-1 chain
    for k in kinds:
        for phase in ("random", "harness"):
            e2e.check_gates(out[k][f"gates_{phase}"], f"{k} prompts, {phase} drafter vs no speculation")
    if state_check:
        sc = out["state_check"]
        assert sc["paths"] > 0 and sc["sibling_paths"] > 0, sc
    assert out["seeded_repeat_equal"] and out["seeded_alone_equal"] and out["seeded_seeds_differ"], out


def host_syncs(llm, prompts) -> dict:
    """One greedy batch under torch's sync debug mode: the host syncs it reports, by the Python file
    that made them ({"ddtree": ours, "other": vLLM's and torch's, "where": file:line counts})."""
    import collections
    import warnings

    import torch

    where = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            generate(llm, prompts)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            where[f"{_package_path(w.filename)}:{w.lineno}"] += 1
    ours = sum(n for f, n in where.items() if "ddtree_compile" in f)
    return {"ddtree": ours, "other": sum(where.values()) - ours, "where": dict(where.most_common(12))}


LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")  # (Triton: cuLaunch*)


def launches(llm, prompts) -> dict:
    """One greedy batch under torch's profiler: CUDA kernels launched outside CUDA graphs and graph
    replays, per DDTree tree step (every launch of the process: vLLM's, torch's and DDTree's), and
    host-to-device copies, from the CUDA runtime and driver calls the profiler records."""
    import collections

    from torch.profiler import ProfilerActivity, profile

    from ddtree_compile.integration import metrics

    before = metrics.collect(llm)[0]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate(llm, prompts)
    steps = metrics.counters_delta(metrics.collect(llm)[0], before)["tree_steps"]
    calls = collections.Counter(e.name for e in prof.events() if e.name.startswith(("cuda", "cu")))
    per = (lambda n: round(n / steps, 2)) if steps else (lambda n: None)
    return {"tree_steps": steps, "kernels_per_step": per(sum(calls[c] for c in LAUNCH_CALLS)),
            "graphs_per_step": per(calls["cudaGraphLaunch"]), "memcpy_per_step": per(calls["cudaMemcpyAsync"]),
            "calls": dict(calls.most_common(12)), "by_owner": eager_ops(llm, prompts)}


def eager_ops(llm, prompts) -> dict:
    """One more greedy batch, every torch operation on CUDA tensors V2's steps dispatch counted by owner
    (DDTree's code or vLLM's: testing/op_count.py; the host's own tensor work left out): outside a
    graph's replay each one that is not a view is a launch or a copy. Per tree step, and DDTree's most
    frequent (Triton launches of its own are not torch operations: the profiler's totals above hold them)."""
    from ddtree_compile.integration import engines, metrics
    from ddtree_compile.testing import op_count

    counter = op_count.OpCount(device="cuda")
    before = metrics.collect(llm)[0]
    stop = op_count.around_steps(engines.find_runner(llm), counter)
    try:
        generate(llm, prompts)
    finally:
        stop()
    steps = metrics.counters_delta(metrics.collect(llm)[0], before)["tree_steps"]
    if not steps:
        return {"tree_steps": 0}
    mine = counter.select(owner="ddtree", views=False)
    return {"tree_steps": steps, "ddtree_per_step": round(sum(mine.values()) / steps, 2),
            "vllm_per_step": round(sum(counter.select(owner="vllm", views=False).values()) / steps, 2),
            "ddtree_top": {k.split("|", 2)[2]: round(n / steps, 2) for k, n in mine.most_common(12)}}


def _package_path(filename: str) -> str:
    """A source file as its package path (vllm/..., torch/..., ddtree_compile/...): no machine path."""
    m = re.search(r"(?:^|/)((?:vllm|torch|ddtree_compile|triton)/.*)$", filename)
    return m.group(1) if m else filename.rsplit("/", 1)[-1]
