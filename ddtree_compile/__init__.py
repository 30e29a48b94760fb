"""ddtree_compile: DDTree speculative decoding for vLLM."""
