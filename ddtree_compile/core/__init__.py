"""The tree algorithm, torch only (no vLLM): one round is build.py -> (the target verifies the tree)
-> walk.py -> commit.py; spec.py holds the settings, tree.py the fixed-shape tree layout,
sampling.py the lossless per-node sampling."""
