"""Replace a live engine's DFlash drafter logits, keeping the drafter's forward.

`DrafterLogitsHook` wraps `drafter.model.compute_logits` on an in-process engine's runner through
the adapter's RunnerView: the drafter still runs (its context bookkeeping and its cost stay real),
then `_compute_logits(original, hidden_states)` decides the logits the tree is built from. It
serves DDTree and vLLM's flat DFlash alike.

Product use: `ddtree-compile precompile` times every (budget, batch) bucket with a drafter that is
never right (cli/precompile.py). Test and benchmark drafters (ddtree_compile.testing: the draft
harness, the oracle) subclass it too.
"""

from __future__ import annotations


class DrafterLogitsHook:
    """Replaces a live engine's DFlash drafter logits with `self._compute_logits(original, hidden)`
    (the drafter's forward still runs). Subclasses implement `_compute_logits`."""

    label = "drafter hook"
    install_hint = ""
    _view = None

    def install(self, llm):
        """On an in-process engine's runner."""
        from ddtree_compile.integration.engines import find_runner

        runner = find_runner(llm)
        if runner is None:
            raise ValueError(f"{self.label}.install needs an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, "
                             f"one worker){self.install_hint}")
        return self.attach(runner)

    def attach(self, runner):
        from ddtree_compile import adapters

        view = adapters.current().view_of(runner)
        if not view.has_drafter():
            raise ValueError(f"the {self.label} needs an engine with a DFlash drafter")
        self._view = view
        # flat DFlash drafting inside a CUDA graph (Model Runner V2): its drafts are rewritten after each
        # proposal, and its logits are left alone; an eager drafter step (no graph: CPU, a batch past the
        # capture sizes) calls compute_logits before V2's propose has handed the view its batch
        if self._flat_drafts is not None and view.wrap_flat_drafts(self._flat_drafts):
            return self
        view.wrap_drafter_logits(self._compute_logits, self._draft_topk, self._flat_drafts)
        return self

    def uninstall(self) -> None:
        if self._view is not None:
            self._view.unwrap_drafter_logits()
            self._view.unwrap_flat_drafts()
            self._view = None

    # Subclasses that also serve vLLM's flat DFlash where it samples its drafts inside a CUDA graph
    # (Model Runner V2: no compute_logits call is reached there) set a method fn(drafts [R, L]) that
    # rewrites the drafts in place with what their logits' top-1 would be.
    _flat_drafts = None

    # Subclasses that know their top-k lists without logits set a method fn(R, L, k, temperature, V,
    # dtype, device) -> (log-probs fp32, ids int64) [R, L, k] ranked as the logits' top-k, or None:
    # where DDTree's drafter graph replays past compute_logits (Model Runner V2), the round takes them
    # after the graph instead of [R * L, V] logits and their top-k, eager work the product has not.
    _draft_topk = None

    def _compute_logits(self, original, hidden_states):
        raise NotImplementedError
