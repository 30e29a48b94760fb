"""One harness for what every end-to-end check does: an engine's lifetime, generation, the lossless gates,
and assertions whose messages show what differed. Used by the CPU suite (in-process engines and the
scripts tests run in subprocesses), the GPU suite (tests/gpu) and the serve tests (HTTP, gates only).

* `engine(**llm_kwargs)`: a `vllm.LLM`, shut down (engines.shutdown: its models freed now) however the
  block ends.
* `complete(llm, prompts, max_tokens, logprobs=None, **sampling)`: one `Completion` (a JSON-able dict:
  prompt ids, generated ids, top log-probs per position, cached prompt tokens) per prompt, greedy unless
  `sampling` says otherwise. `generate` and `generate_with_logprobs` are its two common views.
* `regret_gate(reference, got)`: identical to no speculation up to the first divergence, and a near-tie
  there; `gates` over a batch, `controlled_gate` with vLLM's own flat DFlash as the control,
  `regret_segments` for every divergence of a long output.
* `check_gates(report, label)` and `assert_same(got, want, label)`: assertions whose message names the
  prompt, the first differing position and the tokens around it.
"""

from __future__ import annotations

import contextlib
from typing import TypedDict

from ddtree_compile.integration.engines import shutdown
from ddtree_compile.integration.metrics import counters_delta  # noqa: F401  (tests difference counters through here)

TOL = 0.2  # nats: the regret gate's tolerance (a near-tie of the reference's choice)


class Completion(TypedDict):
    prompt: list[int]  # prompt token ids, as the engine tokenized them
    tokens: list[int]  # generated token ids
    lps: list[dict[int, float]] | None  # per generated position: {token id: log-prob} of the top choices
    cached: int  # prompt tokens read from the prefix cache


@contextlib.contextmanager
def engine(**llm_kwargs):
    """`vllm.LLM(**llm_kwargs)` for the block, shut down however the block ends (an error inside the block
    is raised as it was; the engine's models are freed before the next engine starts)."""
    from vllm import LLM

    llm = LLM(**llm_kwargs)
    try:
        yield llm
    finally:
        shutdown(llm)


def complete(llm, prompts: list, max_tokens: int, logprobs: int | None = None, **sampling) -> list[Completion]:
    """One Completion per prompt (TokensPrompt dicts, or text + multimodal data): greedy and without EOS
    unless `sampling` says otherwise; `logprobs`: that many top choices per generated position."""
    from vllm import SamplingParams

    params = SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **sampling, "max_tokens": max_tokens,
                               "logprobs": logprobs})
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [Completion(prompt=list(o.prompt_token_ids), tokens=list(o.outputs[0].token_ids),
                       lps=[{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs]
                       if logprobs else None, cached=o.num_cached_tokens or 0) for o in outs]


def generate(llm, prompts: list, max_tokens: int, **sampling) -> list[list[int]]:
    """Token ids of each prompt's completion (greedy unless `sampling` says otherwise)."""
    return [c["tokens"] for c in complete(llm, prompts, max_tokens, **sampling)]


def generate_with_logprobs(llm, prompts: list, max_tokens: int, logprobs: int = 5):
    """(token ids, per-position {token: logprob} of the top `logprobs` choices) for each prompt: the
    regret gate's reference."""
    return [(c["tokens"], c["lps"]) for c in complete(llm, prompts, max_tokens, logprobs=logprobs)]


def spec_counters(llm) -> dict:
    """vLLM's own spec-decode counters (needs an engine started with disable_log_stats=False)."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
    return out


# -- comparisons -------------------------------------------------------------------------------------------

def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where two token lists differ (a length mismatch counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def difference(got: list[int], want: list[int], context: int = 3) -> str | None:
    """Where two token lists differ, in words (None where they are equal): the first differing position,
    both sides' tokens around it and both lengths."""
    i = first_divergence(got, want)
    if i is None:
        return None
    lo = max(0, i - context)
    return (f"first difference at token {i} of {len(want)} (got {len(got)}): "
            f"got [{lo}:] {got[lo:i + context + 1]}, want [{lo}:] {want[lo:i + context + 1]}")


def assert_same(got: list[list[int]], want: list[list[int]], label: str = "") -> None:
    """Token lists equal, prompt by prompt; the message names each prompt that differs and where."""
    assert len(got) == len(want), f"{label}: {len(got)} outputs, want {len(want)}"
    diffs = {i: d for i, (g, w) in enumerate(zip(got, want)) if (d := difference(list(g), list(w)))}
    assert not diffs, f"{label}: {len(diffs)} of {len(want)} prompts differ: " + "; ".join(
        f"prompt {i}: {d}" for i, d in diffs.items())


def regret_gate(reference, got: list[int], tol: float = TOL) -> dict:
    """The regret gate: identical to the reference up to the first divergence, and there our token
    is a near-tie of the reference's choice.

    reference: (tokens, per-position {token: logprob}) as from `generate_with_logprobs`.
    Returns {"divergence": index or None, "gap": the reference's top-2 log-prob gap there,
    "second": our token is its second choice, "rank": our token's rank in the listed choices (None:
    not listed), "regret": reference top log-prob minus our token's (a lower bound when unlisted),
    "ok": regret <= tol}. `regret <= tol` is the criterion: with three-way near-ties our token can be
    the third choice at a regret well inside tol (the strict "second choice" flag is reported too).
    """
    ref_tokens, ref_lps = reference
    i = first_divergence(ref_tokens, got)
    if i is None:
        return {"divergence": None, "gap": None, "second": None, "rank": None, "regret": 0.0, "ok": True}
    ranked = sorted(ref_lps[i].items(), key=lambda kv: -kv[1])
    gap = ranked[0][1] - ranked[1][1] if len(ranked) > 1 else float("inf")
    tok = got[i] if i < len(got) else None
    ranks = [t for t, _ in ranked]
    rank = ranks.index(tok) if tok in ranks else None
    regret = ranked[0][1] - (ref_lps[i][tok] if rank is not None else ranked[-1][1])
    return {"divergence": i, "gap": gap, "second": rank == 1, "rank": rank, "regret": regret,
            "ok": rank is not None and regret <= tol, "got": tok,
            "want": ref_tokens[i] if i < len(ref_tokens) else None}


def gates(references: list, outputs: list, tol: float = TOL) -> list[dict]:
    """`regret_gate` of each output against its reference. Either side may be Completions (a reference
    with log-probs) or the (tokens, log-probs) / token-list forms."""
    def ref(r):
        return (r["tokens"], r["lps"]) if isinstance(r, dict) else r

    return [regret_gate(ref(r), g["tokens"] if isinstance(g, dict) else g, tol) for r, g in zip(references, outputs)]


def check_gates(report: list[dict], label: str = "") -> None:
    """Every gate of `report` passed; the message lists each that did not: prompt, position, the token we
    gave and the reference's, the reference's top-2 gap and our regret."""
    bad = [(i, g) for i, g in enumerate(report) if not g["ok"]]
    assert not bad, f"{label}: {len(bad)} of {len(report)} outside the regret gate: " + "; ".join(
        f"prompt {i} at token {g['divergence']}: got {g.get('got')} (rank {g['rank']}), want {g.get('want')}, "
        f"top-2 gap {g['gap']:.3f}, regret {g['regret']:.3f}" for i, g in bad)


def controlled_gate(reference, control, got: list[int], tol: float = TOL) -> dict:
    """The regret gate against no speculation (`reference`), with vLLM's own flat DFlash of the same
    engine settings as the control (`control`: its tokens and logprobs, as `reference`): DDTree passes
    where it is within the gate of either. Where vLLM's own speculative path already leaves no
    speculation (bf16 near-ties of other kernels, its chunked-prefill numerics), DDTree is judged
    against what that path computes; a tree bug still fails both.
    Returns {"ok", "reference": gate vs no speculation, "control": gate vs flat DFlash}."""
    ref, ctl = regret_gate(reference, got, tol), regret_gate(control, got, tol)
    return {"ok": ref["ok"] or ctl["ok"], "reference": ref, "control": ctl}


def regret_segments(ref_llm, cand_llm, prompt: dict, total: int, tol: float = TOL, window: int = 64,
                    draft_harness=None, stop_at_failure: bool = True, max_segments: int | None = None) -> list[dict]:
    """Gate EVERY divergence over `total` tokens: after each (near-tie) divergence both engines
    continue from the reference's prefix through the divergent token, `window` tokens at a time.

    Returns one `regret_gate` record per divergence (with its absolute position `at`); stops at the
    first one that fails (with `stop_at_failure`; else goes on, so a systematic drift shows as many
    failures) or after `max_segments` records. With `draft_harness` (a harness.DraftHarness), its
    reference follows each segment's reference continuation, so the candidate keeps accepting deep
    paths and siblings across segments.
    """
    prefix = list(prompt["prompt_token_ids"])
    done, out = 0, []
    while done < total and (max_segments is None or len(out) < max_segments):
        n = min(window, total - done)
        ref = generate_with_logprobs(ref_llm, [{"prompt_token_ids": prefix}], n)[0]
        if draft_harness is not None:
            draft_harness.reference[tuple(prefix)] = prefix + ref[0]
        got = generate(cand_llm, [{"prompt_token_ids": prefix}], n)[0]
        g = regret_gate(ref, got, tol)
        if g["divergence"] is None:
            prefix += ref[0]
            done += n
            continue
        g["at"] = done + g["divergence"]
        out.append(g)
        if stop_at_failure and not g["ok"]:
            break
        keep = g["divergence"] + 1
        prefix += ref[0][:keep]
        done += keep
    return out
