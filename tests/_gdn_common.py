"""Shared helpers for the tree GatedDeltaNet tests: random trees and a plain sequential oracle
(a chain GDN layer written independently of the templates)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

KINDS = ("chain", "star", "deep", "bushy", "random")


def random_parents(kind: str, n: int, n_live: int, gen: torch.Generator) -> list[int]:
    """Parents of one request: slots 1..n_live-1 live, the rest padding (-1)."""
    def rnd(hi):  # uniform in [0, hi)
        return int(torch.randint(0, hi, (1,), generator=gen))

    p = [-1] * n
    for i in range(1, n_live):
        if kind == "chain":
            p[i] = i - 1
        elif kind == "star":
            p[i] = 0
        elif kind == "deep":
            p[i] = i - 1 if rnd(10) < 8 else rnd(i)
        elif kind == "bushy":
            p[i] = rnd(min(i, 3))
        else:
            p[i] = rnd(i)
    return p


def root_path(parents: list[int], s: int) -> list[int]:
    path = [s]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


class ChainOracle:
    """One GDN layer run token by token in float64: conv window [D, W-1] + state [HV, V, K]."""

    def __init__(self, weight, bias, A_log, dt_bias, H, K, silu=True):
        self.w = None if weight is None else weight.double()
        self.b = None if bias is None else bias.double()
        self.A_log, self.dt_bias, self.H, self.K, self.silu = A_log.double(), dt_bias.double(), H, K, silu

    def conv(self, hist, x):
        win = torch.cat([hist, x.double()[:, None]], 1)
        y = (win * self.w).sum(1)
        if self.b is not None:
            y = y + self.b
        return (F.silu(y) if self.silu else y), win[:, 1:]

    def step(self, hist, S, x, a, b):
        """Returns (output [HV, V], new hist, new S) for one token with pre-conv input x."""
        y, hist = self.conv(hist, x)
        out, S = self.rec(S, y, a, b)
        return out, hist, S

    def rec(self, S, y, a, b):
        """The recurrence alone on a post-conv row y = [q | k | v]: (output [HV, V], new S)."""
        y = y.double()
        H, K = self.H, self.K
        HV, V = S.shape[0], S.shape[1]
        q = y[: H * K].view(H, K)
        k = y[H * K: 2 * H * K].view(H, K)
        v = y[2 * H * K:].view(HV, V)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        g = -self.A_log.exp() * F.softplus(a.double() + self.dt_bias)
        beta = torch.sigmoid(b.double())
        S = S.double().clone()
        out = torch.empty(HV, V, dtype=torch.float64)
        for hv in range(HV):
            hk = hv // (HV // H)
            Sh = S[hv] * g[hv].exp()  # [V, K]
            Sh = Sh + beta[hv] * (v[hv] - Sh @ k[hk])[:, None] * k[hk][None, :]
            S[hv] = Sh
            out[hv] = Sh @ q[hk]
        return out, S

    def run(self, hist, S, xs, as_, bs):
        outs = []
        for x, a, b in zip(xs, as_, bs):
            o, hist, S = self.step(hist, S, x, a, b)
            outs.append(o)
        return outs, hist, S


def poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan")) if t.dtype.is_floating_point else t.fill_(-12345)
