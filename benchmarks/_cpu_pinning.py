"""--pin-cpus: each side-by-side engine's process on CPUs local to its GPU: the same CPUs for every
engine ("same", the default), the same but one logical CPU per physical core ("cores": no engine
thread shares a core with another's hyperthread sibling), the same but only the CPUs that probed
fastest before the engines started ("fast"), the same with each timed run's thread on the CPU that
probes fastest right before it ("run"), or a disjoint slice each ("split").

"same" because the engines' runs alternate (one engine works at a time; an idle engine's processes
block on their queues), so the fair placement gives each the same cores. With disjoint slices (the
first form of this option), on a host of four H100s (`e2e_h100x4_4b_s26.json`, slices 0-20 / 21-41 /
42-63 for flat DFlash / budget 32 / auto) the same host ops took 1.6-2x longer in the two DDTree
engines than in flat's (torch.profiler at c = 1: aten::slice 1.8 us in flat's process, 3.2 us and
2.6 us in theirs; op counts per round within 3-7% of flat's): cores unlike each other (hyperthread
siblings, clocks), or a slower dispatch of every op in those processes, which the host-bound steps of
a 4B at c = 1 turn into tok/s. Each worker runs a host probe before its engine starts
(`host_probe_us_before_start`: the CPUs) and in every cell (`host_probe_us`: the CPUs and whatever the
engine installed in its process), so that a run tells the two apart.

"same" on two H200s (`e2e_h200x2_4b_s27.json`, 32 CPUs local to both GPUs): the probes read ~2.3 or
~3.8 us per op, in both engines' processes alike, before start and in later cells (one process 2.5
us in one cell, 4.2 in the next), and every phase of a step moved with them: the host's speed,
not DDTree's work. Where a process runs among the 32 (a hyperthread whose sibling is busy, or not) is
the likeliest cause, hence "cores"; each timed run now records its own probe (`host_probe_us_runs`).

"cores" on two H200s (`e2e_h200x2_4b_s28.json`): the 32 CPUs are 32 cores to sysfs (a VM: its
vCPUs' hyperthread siblings on the host are invisible), so it pinned as "same" did, and the per-run
probes still flipped between ~2.4 and ~4.2 us within one process from one run to the next. Hence
`probe_each_cpu` at the start and after each profile (`host_probe_us_per_cpu`: do the two speeds
belong to CPUs, and do they stay?) and "fast": every engine on the CPUs that probed fastest at start.
"fast" on four H100s (`e2e_h100x4_4b_s29.json`, 64 CPUs): at every probe about half the CPUs read
~2.2-2.6 us and half ~3.6-4.4, but which half changes: from one probe of all CPUs to the next (minutes
apart) a CPU kept its state 33 times in 64 where chance gives 32, and by the first profile's end 9 of
the 25 CPUs chosen at start were still fast. One process's consecutive timed runs, ~3 s apart, kept
their state 65% of the time (chance 50%): a CPU's state lasts seconds. Hence "run": every engine on
the same CPUs, and before each run its host loop's thread pinned to the one that probes fastest right
then (on_fastest_cpu; the run's `cpu`), for that run only.

Why pin at all: in one H100 run (`e2e_h100x4_4b_s25_alone.json`, three engines on GPU 0, nothing else on the
host) two host phases of the budget-"auto" engine that DDTree does not touch, vLLM's scheduling and
its output processing, read 23-26% and 14-16% slower than flat DFlash's at c = 16, where auto's steps
were mostly chain steps of flat's shape; in the run before it on the same machine
(`e2e_h100x4_4b_s25.json`) the same phases read 4-6% faster than flat's. The likeliest cause is where
the OS placed each process (which socket, which cores it shared); pinning takes it out of the
comparison.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess


def parse_cpulist(text: str) -> list[int]:
    """Linux's cpulist format ("0-3,8,10-11") -> sorted CPU ids."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cpus)


def local_cpus(device: str | None) -> list[int]:
    """The CPUs this process may use that are local to the GPUs with these physical indices ("0" or
    "0,1": sysfs's local_cpulist of each one's PCI device, united); all of them when there is no such
    GPU or the file is missing."""
    allowed = sorted(os.sched_getaffinity(0))
    if device is None:
        return allowed
    local: set[int] = set()
    try:
        for gpu in device.split(","):
            out = subprocess.run(["nvidia-smi", f"--id={gpu}", "--query-gpu=pci.bus_id", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout.strip()
            domain, rest = out.split(":", 1)  # "00000000:18:00.0" -> sysfs "0000:18:00.0"
            path = pathlib.Path("/sys/bus/pci/devices") / f"{domain[-4:]}:{rest}".lower() / "local_cpulist"
            local.update(parse_cpulist(path.read_text()))
    except (OSError, ValueError, subprocess.SubprocessError):
        return allowed
    return [c for c in allowed if c in local] or allowed


def siblings_of(cpu: int) -> list[int]:
    """The logical CPUs of cpu's physical core (sysfs thread_siblings_list; itself alone if unknown)."""
    try:
        path = pathlib.Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        return parse_cpulist(path.read_text())
    except (OSError, ValueError):
        return [cpu]


def one_per_core(cpus, siblings=siblings_of) -> list[int]:
    """The first of cpus on each physical core: the others are hyperthread siblings of one of them."""
    seen: set[int] = set()
    out = []
    for c in cpus:
        if c not in seen:
            out.append(c)
            seen.update(siblings(c))
    return out


def cpus_of_each(devices: list, split: bool = False, local=local_cpus, cores: bool = False,
                 siblings=siblings_of, fast: dict | None = None) -> list[list[int]]:
    """Each engine's CPUs: those local to its GPU(s); cores: one per physical core of those; fast (a
    probe_each_cpu result): the fastest of those (fastest_cpus); split: one disjoint slice per engine
    (the engines whose GPUs share a set of local CPUs split that set evenly, in order, contiguous
    slices; an engine gets at least one CPU, shared if there are more engines than CPUs)."""
    of_device = {d: tuple(local(d)) for d in dict.fromkeys(devices)}  # (one nvidia-smi call per GPU)
    if cores:
        of_device = {d: tuple(one_per_core(c, siblings)) for d, c in of_device.items()}
    if fast:
        of_device = {d: tuple(fastest_cpus(c, fast)) for d, c in of_device.items()}
    if not split:
        return [list(of_device[d]) for d in devices]
    groups: dict[tuple, list[int]] = {}
    for i, d in enumerate(devices):
        groups.setdefault(of_device[d], []).append(i)
    out: list[list[int]] = [[] for _ in devices]
    for cpus, members in groups.items():
        for k, i in enumerate(members):
            lo, hi = k * len(cpus) // len(members), (k + 1) * len(cpus) // len(members)
            out[i] = list(cpus[lo:hi]) or [cpus[k % len(cpus)]]
    return out


def probe_each_cpu(cpus, probe=None) -> dict[int, float]:
    """host_probe_us on each of `cpus`, this thread pinned to one at a time (its affinity restored
    after): whether the host's two speeds (module docstring) belong to CPUs or to moments."""
    probe = probe or (lambda: host_probe_us(500))
    saved, out = os.sched_getaffinity(0), {}
    try:
        for c in cpus:
            os.sched_setaffinity(0, {c})
            out[c] = probe()
    finally:
        os.sched_setaffinity(0, saved)
    return out


@contextlib.contextmanager
def on_fastest_cpu(probe=None):
    """For the block, this thread on the CPU of its affinity that probes fastest now ("run": one timed
    run's host loop); yields (that CPU, its probe in us per op). Its affinity is restored after; the
    process's other threads keep theirs."""
    saved = os.sched_getaffinity(0)
    speeds = probe_each_cpu(sorted(saved), probe)
    cpu = min(speeds, key=lambda c: (speeds[c], c))
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu, speeds[cpu]
    finally:
        os.sched_setaffinity(0, saved)


def fastest_cpus(cpus, speeds: dict, tolerance: float = 1.15, least: int = 4) -> list[int]:
    """Those of `cpus` whose probe (speeds: CPU -> us per op) reads within `tolerance` of the fastest
    of them, at least the `least` fastest (an engine's processes need a few CPUs); unprobed CPUs are left
    out, unless none of them was probed (then all of them)."""
    known = sorted((speeds[c], c) for c in cpus if c in speeds)
    if not known:
        return list(cpus)
    keep = {c for us, c in known if us <= tolerance * known[0][0]} | {c for _, c in known[:least]}
    return [c for c in cpus if c in keep]


def host_probe_us(n: int = 2000) -> float:
    """Microseconds per small host op (a CPU tensor's slice, view and add, the kind of op vLLM's and
    DDTree's step issue by the hundred): the best of 3 loops of n, ~40 ms at 2 us per op. Alike
    across a run's engines when their CPUs are alike."""
    import time

    import torch

    x, best = torch.ones(8), float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            x[1:3].view(2).add(1)
        best = min(best, time.perf_counter() - t)
    return best / (3 * n) * 1e6
