"""FX graph passes (installed as ddtree_compile.passes).

rules.py   the rewrite-rule table (data) and its loader
engine.py  the generic engine that applies the rules to a post-grad graph
entry.py   `tree_verify_pass`, the object vLLM calls as its post-grad custom pass
"""
