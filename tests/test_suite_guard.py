"""The suite cannot pass empty: a guard over every test module (tests/ and tests/gpu/), read as source.

* No non-strict xfail: `pytest.mark.xfail` names `strict=True` (a known upstream bug, stated in its
  reason), and no test calls `pytest.xfail()` (an imperative xfail is never strict).
* No test whose asserts are all conditional: a test that asserts something must assert it on every path
  through its body, or say on the other paths why it does not apply (`pytest.skip(reason)`) or that it
  failed (`pytest.fail`, `raise`). A test with no assert of its own (one that calls a checking helper)
  is not judged here.

The rules are first shown to catch what they are about (tests on small sources), then run on the suite.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
ENDS_TEST = {"skip", "fail", "exit"}  # pytest.<name>(...): the test ends with a stated outcome


def _is_pytest_call(node: ast.AST, names: set[str]) -> bool:
    """`pytest.<name>(...)` for a name in `names`."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "pytest")


def _xfail_marks(tree: ast.AST):
    """Every `pytest.mark.xfail(...)` call (decorators, pytestmark, pytest.param marks) and bare
    `pytest.mark.xfail`, with its line."""
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        if id(node) in called:
            continue  # the call itself is the mark
        target = node.func if isinstance(node, ast.Call) else node
        if (isinstance(target, ast.Attribute) and target.attr == "xfail" and isinstance(target.value, ast.Attribute)
                and target.value.attr == "mark"):
            yield node


def non_strict_xfails(source: str) -> list[str]:
    """'line N: ...' for each xfail that is not strict, and each imperative pytest.xfail() call."""
    tree, out = ast.parse(source), []
    for node in _xfail_marks(tree):
        keywords = node.keywords if isinstance(node, ast.Call) else []
        strict = next((k.value for k in keywords if k.arg == "strict"), None)
        if not (isinstance(strict, ast.Constant) and strict.value is True):
            out.append(f"line {node.lineno}: pytest.mark.xfail without strict=True")
    for node in ast.walk(tree):
        if _is_pytest_call(node, {"xfail"}):
            out.append(f"line {node.lineno}: pytest.xfail() call (never strict)")
    return out


def _ends(stmts: list[ast.stmt]) -> bool:
    """Every path through `stmts` asserts, raises, or ends the test with a stated outcome."""
    return any(_stmt_ends(s) for s in stmts)


def _stmt_ends(s: ast.stmt) -> bool:
    if isinstance(s, (ast.Assert, ast.Raise)):
        return True
    if isinstance(s, ast.Expr) and _is_pytest_call(s.value, ENDS_TEST):
        return True
    if isinstance(s, ast.If):
        return _ends(s.body) and _ends(s.orelse)
    if isinstance(s, (ast.With, ast.AsyncWith)):
        raises = any(_is_pytest_call(i.context_expr, {"raises", "warns"}) for i in s.items)
        return raises or _ends(s.body)
    if isinstance(s, ast.Try):
        return _ends(s.body) or (_ends(s.finalbody) if s.finalbody else False)
    if isinstance(s, (ast.For, ast.AsyncFor, ast.While)):
        return _ends(s.body)  # a loop's asserts are the test's (an empty loop is the test's own input)
    if isinstance(s, ast.Match):
        return all(_ends(c.body) for c in s.cases)
    return False


def _own_asserts(fn: ast.FunctionDef) -> bool:
    """The function body asserts something itself (not counting nested functions)."""
    todo = list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Assert) or (isinstance(node, ast.With) and any(
                _is_pytest_call(i.context_expr, {"raises", "warns"}) for i in node.items)):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))
    return False


def conditional_only_tests(source: str) -> list[str]:
    """'name (line N)' for each test function that asserts, but only on some paths through its body, with
    no skip, fail or raise on the others."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")
                and _own_asserts(node) and not _ends(node.body)):
            out.append(f"{node.name} (line {node.lineno})")
    return out


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p.name.startswith(("test_", "_")) or p.name == "conftest.py")


# -- the rules catch what they are about -------------------------------------------------------------------

@pytest.mark.parametrize("source, found", [
    ("@pytest.mark.xfail(strict=" + "False, reason='x')\ndef test_a(): assert f()", 1),  # (split: no grep hit)
    ("@pytest.mark.xfail(reason='x')\ndef test_a(): assert f()", 1),
    ("@pytest.mark.xfail\ndef test_a(): assert f()", 1),
    ("pytestmark = pytest.mark.xfail(reason='x')", 1),
    ("P = [pytest.param(1, marks=pytest.mark.xfail(reason='x'))]", 1),
    ("def test_a():\n    if f():\n        pytest.xfail('known')\n    assert g()", 1),
    ("@pytest.mark.xfail(strict=True, reason='upstream bug #1')\ndef test_a(): assert f()", 0),
])
def test_the_guard_finds_non_strict_xfails(source, found):
    assert len(non_strict_xfails(source)) == found, non_strict_xfails(source)


@pytest.mark.parametrize("source, found", [
    # the shape issue 59 found: every assert under an `if` the other CPU kind does not take
    ("def test_a(r):\n    if r['kind'] == 'x':\n        assert r['block'] == 256\n        assert r['chunked']", 1),
    ("def test_a(r):\n    if r:\n        assert r\n    elif r is None:\n        assert 1", 1),
    ("def test_a(r):\n    for x in r:\n        if x:\n            assert x", 1),
    # every path asserts, skips with a reason or fails
    ("def test_a(r):\n    if r['kind'] != 'x':\n        pytest.skip('why')\n    assert r['block'] == 256", 0),
    ("def test_a(r):\n    if r:\n        assert r\n    else:\n        assert not r", 0),
    ("def test_a(r):\n    if not r:\n        raise AssertionError(r)\n    assert r", 0),
    ("def test_a(r):\n    with pytest.raises(ValueError):\n        f(r)", 0),
    ("def test_a(r):\n    try:\n        assert f(r)\n    finally:\n        g()", 0),
    ("def test_a(r):\n    check(r)", 0),  # no assert of its own: the helper's (not judged)
    ("def test_a(r):\n    def inner():\n        if r:\n            assert r\n    check(inner)", 0),
])
def test_the_guard_finds_tests_whose_asserts_are_all_conditional(source, found):
    assert len(conditional_only_tests(source)) == found, conditional_only_tests(source)


# -- the suite ---------------------------------------------------------------------------------------------

def test_the_suite_has_modules_to_guard():
    names = {p.name for p in _modules()}
    assert len(names) > 50 and {"test_runner_v2_cpu.py", "test_v2.py", "test_suite_guard.py"} <= names, sorted(names)


def test_no_non_strict_xfail_in_the_suite():
    found = {str(p.relative_to(TESTS)): f for p in _modules() if (f := non_strict_xfails(p.read_text()))}
    assert not found, f"non-strict xfails (a test that passes whether the product is right or not): {found}"


def test_no_test_whose_asserts_are_all_conditional():
    found = {str(p.relative_to(TESTS)): f for p in _modules() if (f := conditional_only_tests(p.read_text()))}
    assert not found, (f"tests that pass having checked nothing on some paths: {found}; on a path where the "
                       f"check does not apply, pytest.skip(reason)")


def test_the_gpu_evidence_holds_no_superseded_record():
    """benchmarks/results/gpu_suite.json: no module-level crash entry that a later test entry superseded,
    no entry of a test that no longer exists (tests/gpu/conftest.py prunes them at every merge)."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("gpu_conftest", TESTS / "gpu" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    tests = json.loads((TESTS.parent / "benchmarks/results/gpu_suite.json").read_text())["tests"]
    stale = sorted(set(tests) - set(conftest.prune(tests)))
    assert len(tests) > 20 and not stale, stale
    # the rule itself: a module's setup error is dropped once one of its tests has a later entry
    fake = {"test_v2.py": {"finished": "1"}, "test_v2.py::test_qwen3_eager_on_v2": {"finished": "2"},
            "test_v2.py::test_gone": {"finished": "2"}}
    assert list(conftest.prune(fake)) == ["test_v2.py::test_qwen3_eager_on_v2"], conftest.prune(fake)


def test_device_commands_results_merge_by_test_id(tmp_path):
    """tests/gpu/merge_results.py: each device command's own results file merged into the evidence, the
    later entry of a test winning, entries of tests that no longer exist pruned."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("gpu_merge", TESTS / "gpu" / "merge_results.py")
    merge = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge)
    into = tmp_path / "gpu_suite.json"
    a, b = "test_v2.py::test_qwen3_eager_on_v2", "test_kernels.py::test_gdn_resume_against_its_reference"
    into.write_text(json.dumps({"what": "w", "updated": "1", "tests": {a: {"finished": "1", "outcome": "failed"}}}))
    parts = [tmp_path / "p1.json", tmp_path / "p2.json"]
    parts[0].write_text(json.dumps({"updated": "3", "tests": {a: {"finished": "3", "outcome": "passed"},
                                                               "test_v2.py::test_gone": {"finished": "3"}}}))
    parts[1].write_text(json.dumps({"updated": "2", "tests": {a: {"finished": "2", "outcome": "failed"},
                                                               b: {"finished": "2", "outcome": "passed"}}}))
    doc = merge.merge(parts, into)
    assert doc == json.loads(into.read_text())
    assert doc["updated"] == "3" and doc["what"] == "w"
    assert doc["tests"] == {b: {"finished": "2", "outcome": "passed"}, a: {"finished": "3", "outcome": "passed"}}
