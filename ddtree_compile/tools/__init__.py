"""Tools around the product: the `ddtree-compile` CLI (demo, round, dump), tiny offline models,
and the test drafter harness."""
