"""DDTree's round inside vLLM's V1 model runner: build_stage -> verify_stage -> walk_stage ->
commit_stage, composed by state.py; start-up checks in checks.py."""

from .checks import UnsupportedEngine, unsupported_reason, validate
from .state import DDTreeRound, attach

__all__ = ["DDTreeRound", "UnsupportedEngine", "attach", "unsupported_reason", "validate"]
