"""Timed generation through the engine's own steps (benchmarks and `precompile`).

`llm.llm_engine.step()` is walked by hand and every step is stamped, so the time per output token
(TPOT) is known per request and per step, not only as a batch average. Public vLLM API only.
"""

from __future__ import annotations

import itertools
import statistics
import time

_IDS = itertools.count()


def timed_steps(llm, prompts: list[dict], max_tokens: int) -> dict:
    """Greedy-generate `prompts` as one batch: wall time, steps, output tokens, tok/s, TPOT p50/p90
    (the first token of a request is its prefill's, TTFT, and not counted), the outputs in prompt
    order, started_s (perf_counter at the start: a system-wide clock, comparable across processes) and
    peak_batch: the most requests that got tokens in one step (fewer than the prompts when the KV cache
    cannot hold them all at once: the run then measured smaller batches than it names)."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    run = next(_IDS)
    ids = [f"timed{run}-{i}" for i in range(len(prompts))]
    seen, last, gaps, outs, steps, peak = {}, {}, [], {}, 0, 0
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, params)
    while eng.has_unfinished_requests():
        step_out = eng.step()
        steps += 1
        t = time.perf_counter()
        advanced = 0
        for o in step_out:
            n = len(o.outputs[0].token_ids)
            new = n - seen.get(o.request_id, 0)
            if new > 0:
                advanced += 1
                if o.request_id in last:
                    gaps += [(t - last[o.request_id]) / new] * new
                last[o.request_id], seen[o.request_id] = t, n
            outs[o.request_id] = list(o.outputs[0].token_ids)
        peak = max(peak, advanced)
    wall = time.perf_counter() - t0
    tokens = sum(len(v) for v in outs.values())
    q = statistics.quantiles(gaps, n=10) if len(gaps) >= 2 else [float("nan")] * 9
    return {"wall_s": wall, "steps": steps, "output_tokens": tokens, "tok_s": tokens / wall, "started_s": t0,
            "peak_batch": peak,
            "tpot_p50_ms": 1e3 * q[4], "tpot_p90_ms": 1e3 * q[8],
            "outputs": [outs.get(i, []) for i in ids]}
