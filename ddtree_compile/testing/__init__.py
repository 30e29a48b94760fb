"""Test and benchmark support, never imported by the product: tiny offline models and tokenizer,
the test drafter harness, the benchmark's oracle drafter, a `vllm serve` subprocess runner, and
the vLLM end-to-end demo (`make demo`, `python -m ddtree_compile.testing.demo`)."""
