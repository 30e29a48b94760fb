"""Calibrate the oracle drafter's acceptance profiles to published numbers (CPU, ~2-5 min).

    python benchmarks/calibrate_oracle.py --out benchmarks/oracle_profiles.json

Chain: 5.6 tokens per round at 15 draft tokens (vLLM's DFlash on Qwen3.5-4B, H100). Tree gains
over that chain: +4% (the prior vLLM port's tree), +22% at budget 32 (SGLang's DFlash tree
verify), 1.35x (the DDTree paper's best case). And a low-acceptance profile, `thinking_2p5`: the
chain at 2.5 tokens per round (as with thinking on, where a DDTree port read 0.51x of the chain),
its misses held in the list as port_plus4's are, the least a published tree gained (its tree gain
simulated, not a target: none is published at this acceptance). Per depth the true token is at rank 0 with p0, else at ranks
1..7 (geometric, decay 0.25) with the calibrated share, else absent; depths are independent.
bench_e2e_gpu.py reads the JSON.
"""

import argparse
import json
import pathlib
import time

from ddtree_compile.testing import oracle

CHAIN_TOKENS, DRAFT_LEN = 5.6, 15
# name -> (gain over the chain, budget it is calibrated at). The +4% port number and the paper's
# best case name no budget; 32 and 64 are ours (1.35x is out of reach at 32 with a 5.6 chain
# and independent depths: every miss in the list gives ~1.22x there).
TARGETS = {"port_plus4": (1.04, 32), "sglang_plus22": (1.22, 32), "paper_1p35": (1.35, 64)}
LOW = ("thinking_2p5", 2.5, "port_plus4", 32)  # name, chain tokens per round, whose list share, budget


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/oracle_profiles.json")
    ap.add_argument("--samples", type=int, default=4000)
    args = ap.parse_args()
    t0 = time.perf_counter()
    profiles = [oracle.calibrate(n, CHAIN_TOKENS, g, b, draft_len=DRAFT_LEN, samples=args.samples)
                for n, (g, b) in TARGETS.items()]
    name, chain, like, budget = LOW
    miss = next(p["miss_in_list"] for p in profiles if p["name"] == like)
    profiles.append(oracle.calibrate(name, chain, None, budget, draft_len=DRAFT_LEN, samples=args.samples,
                                     miss_in_list=miss))
    for p in profiles:
        print(f"{p['name']:<14} p0 {p['p0']:.4f} miss_in_list {p['miss_in_list']:.3f} gain {p['simulated_gain']:.3f} "
              f"(target {p['target_gain']} at budget {p['calibration_budget']}, reached {p['reached']})")
    pathlib.Path(args.out).write_text(json.dumps({"chain_tokens_per_round": CHAIN_TOKENS, "draft_len": DRAFT_LEN,
                                                 "samples": args.samples, "seconds": time.perf_counter() - t0,
                                                 "profiles": profiles}, indent=1))


if __name__ == "__main__":
    main()
