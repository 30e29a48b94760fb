"""The package's shape, as the redesign promised it: no import cycle (imports inside functions
counted), vLLM's private names only in the adapters, the product never importing its test support
(ddtree_compile.testing), short modules. Read from the source (AST), nothing imported.

And the repository's: a short README, indexed results without machine paths, no module over MAX_LINES
in benchmarks and tests either, runs named as runs (or by date). Plain file checks, at the end."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("ddtree_compile", "passes", "templates")
TESTING = "ddtree_compile.testing"  # test and benchmark support: never imported by the product
MAX_LINES = 400


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if any(p.is_symlink() for p in [path, *path.parents] if ROOT in p.parents):
                continue  # a clone's ddtree_compile/passes -> ../passes link: the same files
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            if parts[0] in ("passes", "templates"):  # installed as ddtree_compile.passes / .templates
                parts.insert(0, "ddtree_compile")
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path):
    """(imported module, imported names) of every import statement, those inside functions too."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            yield base, [a.name for a in node.names]


def _internal_targets(base: str, names: list[str]) -> set[str]:
    """The package's modules an import statement loads (a `from pkg import mod` loads pkg.mod)."""
    out = {base} if base in MODULES else set()
    out |= {f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES}
    return out


def test_modules_found():
    assert "ddtree_compile.adapters.vllm_0_32" in MODULES and "ddtree_compile.templates.ops" in MODULES
    assert len(MODULES) > 30


def _graph() -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for m, path in MODULES.items():
        for base, names in _imports(m, path):
            graph[m] |= _internal_targets(base, names) - {m}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return cycles


def test_no_import_cycle():
    """Imports form a DAG, those inside functions included (a lazy import only hides a cycle: the
    modules still need each other). `from pkg import mod` is an edge to pkg's __init__ too, and
    package __init__ -> submodule edges count like any other: a module that the package __init__
    reaches imports the leaf module it uses (`import ddtree_compile.adapters as adapters`)."""
    graph = _graph()
    assert sum(map(len, graph.values())) > 40  # relative imports resolved: the graph is not empty
    assert "ddtree_compile.integration.tree_context" in graph["ddtree_compile.integration.round.graphs"]
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_a_cycle_would_be_found(tmp_path):
    """The checker itself: modules importing each other in a ring are reported, an import inside
    a function closing the ring too."""
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("from c import x\n")
    (tmp_path / "c.py").write_text("def f():\n    from a import y\n")
    graph = {n: {base for base, _ in _imports(n, tmp_path / f"{n}.py")} for n in "abc"}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _testing_imports(name: str, path: pathlib.Path) -> list[str]:
    """The imports of `path` (module `name`) that load ddtree_compile.testing or a module of it."""
    bad = []
    for base, names in _imports(name, path):
        loaded = [base] + [f"{base}.{n}" for n in names]
        if any(m == TESTING or m.startswith(TESTING + ".") for m in loaded):
            bad.append(f"{base}: {names}" if names else base)
    return bad


PRODUCT = sorted(m for m in MODULES if m != TESTING and not m.startswith(TESTING + "."))


@pytest.mark.parametrize("name", PRODUCT)
def test_the_product_never_imports_its_test_support(name):
    """ddtree_compile.testing (tiny models, drafter harness, oracle, demo) is for tests and benchmarks:
    no product module imports it, not even inside a function."""
    bad = _testing_imports(name, MODULES[name])
    assert not bad, f"{MODULES[name].relative_to(ROOT)} imports the test support: {bad}"


def test_a_testing_import_would_be_found(tmp_path):
    pkg = tmp_path / "ddtree_compile" / "cli"
    pkg.mkdir(parents=True)
    cases = {"lazy": "def main():\n    from ddtree_compile.testing import models\n",
             "package": "from ddtree_compile import testing\n",
             "relative": "from ..testing.harness import generate\n",
             "clean": "import torch.testing\nfrom ddtree_compile import adapters\n"}
    found = {}
    for mod, src in cases.items():
        (pkg / f"{mod}.py").write_text(src)
        found[mod] = _testing_imports(f"ddtree_compile.cli.{mod}", pkg / f"{mod}.py")
    assert found == {"lazy": ["ddtree_compile.testing: ['models']"], "package": ["ddtree_compile: ['testing']"],
                     "relative": ["ddtree_compile.testing.harness: ['generate']"], "clean": []}


@pytest.mark.parametrize("name", sorted(m for m in MODULES if ".adapters" not in m))
def test_vllm_private_names_only_in_the_adapters(name):
    """Outside ddtree_compile/adapters/, imports from vLLM name public modules and symbols only."""
    bad = []
    for base, names in _imports(name, MODULES[name]):
        if base.split(".")[0] != "vllm":
            continue
        private = [p for p in base.split(".") + names if p.startswith("_") and p != "__version__"]
        if private:
            bad.append(f"{base}: {private}")
    assert not bad, bad


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_short(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name].relative_to(ROOT)} has {lines} lines (> {MAX_LINES}): split it"


# Fields of vLLM's objects (configs, runner, input batch, scheduler output, sampler and attention
# metadata) that the round reads: outside the adapters only the runner interface names them.
VLLM_FIELDS = {
    "vllm_config", "speculative_config", "model_config", "compilation_config", "scheduler_config", "cache_config",
    "parallel_config", "input_batch", "drafter", "speculator", "rejection_sampler", "requests", "kv_cache_config",
    "static_forward_context", "scheduled_spec_decode_tokens", "sampled_token_ids", "logprobs_tensors", "all_greedy",
    "num_draft_tokens", "draft_token_ids", "logits_indices", "max_spec_len", "seq_lens", "spec_state_indices_tensor",
    "num_accepted_tokens", "mrope_positions", "inductor_compile_config", "additional_config",
}
# Names that hold vLLM objects where vLLM hands them to a hook: read only through the interface.
VLLM_OBJECTS = {"runner", "scheduler_output", "sampling_metadata", "spec_decode_metadata", "attn_metadata",
                "spec_metadata", "vllm_config"}
OUTSIDE_ADAPTERS = sorted(m for m in PRODUCT if ".adapters" not in m and ".cli" not in m)


def _vllm_reads(path: pathlib.Path) -> list[str]:
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value.id if isinstance(node.value, ast.Name) else None
        if node.attr in VLLM_FIELDS or base in VLLM_OBJECTS:
            bad.append(f"{ast.unparse(node)} (line {node.lineno})")
    return bad


@pytest.mark.parametrize("name", OUTSIDE_ADAPTERS)
def test_vllm_objects_are_read_only_through_the_adapters(name):
    """The round talks to vLLM through the runner interface (adapters/interface.py): no module outside
    ddtree_compile/adapters/ reads a field of a vLLM object or an attribute of what vLLM hands a hook.
    (The CLI drives the public `vllm.LLM` API and is not checked.)"""
    bad = _vllm_reads(MODULES[name])
    assert not bad, f"{MODULES[name].relative_to(ROOT)} reads vLLM objects: {bad}"


def test_a_vllm_read_would_be_found(tmp_path):
    (tmp_path / "m.py").write_text("def f(runner, md, x):\n    a = runner.positions\n    b = md.seq_lens[:3]\n"
                                   "    return x.view.positions(a)\n")
    assert _vllm_reads(tmp_path / "m.py") == ["runner.positions (line 2)", "md.seq_lens (line 3)"]


# The repository's layout.

RESULTS = ROOT / "benchmarks" / "results"
README_MAX_LINES = 300

# The project's own files; build outputs, the venv and git's folder are not the project.
PROJECT = ["README.md", "CHANGELOG.md", "Makefile", "pyproject.toml", "setup_cpu.py",
           "docs", "benchmarks", "tests", "ddtree_compile", "passes", "templates", "examples"]
TEXT = {".py", ".md", ".sh", ".toml", ".json", ".txt", ".cfg", ".ini", ".yaml", ".yml", ".log"}
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".hypothesis"}

# The word is spelled apart so that this file passes its own check.
RUN_WORD = re.compile(r"\b" + "sess" + r"ions?\b", re.IGNORECASE)
# Library identifiers that contain the word and are not prose: pytest's fixture scope, an attribute
# named after a client class of requests or aiohttp. Stripped first.
API_IDENTIFIERS = re.compile(r"""scope\s*=\s*["']""" + "sess" + r"""ion["']|\.""" + "Sess" + r"ion\b")
# Absolute paths of a machine (a user's home, scratch and work folders, system prefixes).
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:tmp|work|root|home|Users|mnt|scratch|opt|var|data)/")


def _project_files():
    for entry in PROJECT:
        path = ROOT / entry
        if path.is_file():
            yield path
        elif path.is_dir():
            for p in sorted(path.rglob("*")):
                if p.is_file() and not SKIP_DIRS & set(p.relative_to(ROOT).parts):
                    yield p


def _rel(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _text_files():
    return [p for p in _project_files() if p.suffix in TEXT or p.name == "Makefile"]


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): history goes to CHANGELOG.md"


def test_every_result_file_has_an_index_entry():
    index = (RESULTS / "INDEX.md").read_text()
    missing = [_rel(p) for p in sorted(RESULTS.rglob("*"))
               if p.is_file() and p.name != "INDEX.md" and f"`{p.name}`" not in index]
    assert not missing, f"results without an entry (`NAME`: what, machine, command, commit) in INDEX.md: {missing}"


def test_result_files_record_no_machine_path():
    found = []
    for p in sorted(RESULTS.rglob("*")):
        if p.is_file() and p.suffix in TEXT:
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
                if MACHINE_PATH.search(line):
                    found.append(f"{_rel(p)}:{i}: {line.strip()[:120]}")
    assert not found, "machine paths in results (record paths relative to the repository):\n" + "\n".join(found[:20])


def test_no_run_is_called_by_the_other_word():
    found = []
    for p in _text_files():
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if RUN_WORD.search(API_IDENTIFIERS.sub("", line)):
                found.append(f"{_rel(p)}:{i}: {line.strip()[:120]}")
    assert not found, 'say "run" or give a date:\n' + "\n".join(found[:30])


def test_benchmarks_tests_and_examples_stay_short():
    """test_modules_stay_short's limit for every other Python file of the project."""
    long = {}
    for p in _project_files():
        if p.suffix == ".py" and p.relative_to(ROOT).parts[0] not in PACKAGES:
            n = len(p.read_text().splitlines())
            if n > MAX_LINES:
                long[_rel(p)] = n
    assert not long, f"modules over {MAX_LINES} lines (split them by topic): {long}"


def test_the_guards_see_what_they_guard():
    """The checks above pass vacuously if they read nothing: they must see this repository's files."""
    names = {_rel(p) for p in _text_files()}
    assert {"README.md", "CHANGELOG.md", "tests/test_structure.py", "benchmarks/bench_e2e_gpu.py"} <= names
    assert RUN_WORD.search("one " + "Sess" + "ion later") and not RUN_WORD.search("start_new_" + "sess" + "ion")
    assert not RUN_WORD.search(API_IDENTIFIERS.sub("", '@pytest.fixture(scope="' + "sess" + 'ion")'))
    assert MACHINE_PATH.search('"profiles": "/work/main/x.json"') and not MACHINE_PATH.search("build/m4 a/tmp/b")
