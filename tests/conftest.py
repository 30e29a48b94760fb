"""Suite-wide environment, set before any test module imports triton, vLLM or huggingface_hub."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub, ever
os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run in the interpreter on CPU
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in-process: faster, patchable
