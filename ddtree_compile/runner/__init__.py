"""DDTree inside vLLM's V1 model runner: start-up checks (checks.py), the round (state.py and its stages)."""

from .checks import UnsupportedEngine, unsupported_reason, validate
from .state import DDTreeState, attach

__all__ = ["DDTreeState", "UnsupportedEngine", "attach", "unsupported_reason", "validate"]
