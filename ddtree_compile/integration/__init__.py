"""DDTree inside vLLM: the switch (config.py), the plugin, the op swap the compiler pass installs
(tree_ops.py, tree_context.py), vLLM's KV-cache layouts, metrics, in-process engines, and the round
on the model runner (round/). vLLM's internals are reached only through ddtree_compile.adapters."""
