"""Per-node target tokens for the walk: greedy argmax, or lossless seeded sampling.

Sampling draws every node's token from the target's own distribution at that node (Gumbel-max),
then the walk follows matching children: each committed token is an exact sample given its
accepted prefix, at any temperature (SpecInfer's sample-and-walk; no draft q is involved).

The Gumbel noise is a counter-based hash of (request seed, token position, vocab id): no
generator state, no host sync, the same numbers on any device, and siblings at one position
share noise, which is what makes a seeded run reproducible across tree shapes. Positions whose
noise decided a committed token are never reused: the next round samples later positions.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**27, so x * _MIX stays inside int64 for 32-bit x


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = (((x >> 16) ^ x) * _MIX) & _M32
    x = (((x >> 16) ^ x) * _MIX) & _M32
    return (x >> 16) ^ x


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 Gumbel(0, 1) noise [R, N, V] keyed by seeds [R] and positions [R, N]."""
    seed = seeds.to(torch.int64).view(-1, 1, 1)
    seed = _mix32((seed & _M32) ^ _mix32((seed >> 32) & _M32))
    pos = _mix32(positions.to(torch.int64).unsqueeze(-1) & _M32)
    vocab = torch.arange(vocab_size, device=positions.device, dtype=torch.int64)
    h = _mix32(seed ^ _mix32(pos ^ _mix32(vocab + 0x9E37)))
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 2**24)  # in (0, 1)
    return -torch.log(-torch.log(u))


def sample_target_tokens(
    logits: torch.Tensor,
    temperature,
    seeds: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Target token per node [R, N] from target logits [R, N, V].

    temperature: a float or a tensor [R]; rows with temperature <= 0 are greedy (argmax).
    seeds [R] and positions [R, N] (the absolute position of the token being drawn) key the noise;
    both are required when any row samples.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [R, N, V], got {tuple(logits.shape)}")
    R, N, V = logits.shape
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device).reshape(-1)
    if temp.numel() not in (1, R):
        raise ValueError(f"temperature must be a float or a tensor of shape [R] = [{R}], got {temp.numel()} values")
    temp = temp.expand(R)
    greedy = logits.argmax(-1)
    if isinstance(temperature, (int, float)) and temperature <= 0:
        return greedy
    if seeds is None or positions is None:
        raise ValueError("sampling (temperature > 0) needs seeds [R] and positions [R, N]")
    if seeds.shape != (R,) or positions.shape != (R, N):
        raise ValueError(f"seeds must be [R] and positions [R, N] = {(R, N)}, got {tuple(seeds.shape)}, {tuple(positions.shape)}")
    scaled = logits.float() / temp.clamp(min=1e-6).view(R, 1, 1)
    sampled = (scaled + gumbel_noise(seeds, positions, V)).argmax(-1)
    return torch.where((temp > 0).view(R, 1), sampled, greedy)
