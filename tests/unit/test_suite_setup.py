"""The suite's own setup: the extras it needs are named when missing (conftest.py), its markers select what they say,
and its layout holds, checked from the sources:
- every test module lives in a kind folder, tests/{unit,kernels,distributed,tools,gpu}/, under a name no other test
  module has; every other Python file of tests/ is tests/conftest.py (the one conftest), a module of tests/support/,
  or the GPU proof beside its test in tests/gpu/;
- a test module that launches ranks (torchrun, run_ranks, run_or_fail with ranks, accelerate launch, the deepspeed
  launcher, the scenario_results fixture, an example script that launches) lives in tests/distributed/ (the GPU
  proof's rehearsal in tests/gpu/) and declares `pytestmark` multi_rank; every module of tests/distributed/ does;
- a test module that skips without a CUDA device declares the gpu mark;
- nothing under tests/, benchmarks/ or tools/ puts examples/ on sys.path or imports a module of examples/ (what the
  examples share lives in deepspeed_bnb.demo and deepspeed_bnb.utils.teardown; a test drives an example script by
  loading its file, tests/support/examples.py); no test module imports another, and tests/support's modules are
  imported as support.<module>.
Controls: a module that is there passes the extras check; a module without ranks is not marked multi_rank; a tree
that breaks each layout rule once is flagged once per break, and the files that keep them are not.
"""

import ast
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

import conftest
from conftest import ROOT
from support.sources import python_files


def test_the_checked_modules_are_the_test_extra():
    with open(os.path.join(ROOT, "setup.py")) as f:
        extra = re.search(r'"test": \[([^\]]*)\]', f.read()).group(1)
    names = {re.split(r"[<>=!~\[; ]", item.strip().strip('"'))[0] for item in extra.split(",") if item.strip()}
    assert names - {"pytest"} == set(conftest.TEST_EXTRA)


def session(*args):
    """What pytest_sessionstart reads of a session started in the repository root with these arguments."""
    return SimpleNamespace(config=SimpleNamespace(invocation_params=SimpleNamespace(dir=ROOT), args=list(args)))


def test_a_missing_extra_is_named_with_the_fix(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    for args in (("tests",), (), ("tests", "tests/kernels/test_self_check.py")):
        with pytest.raises(pytest.UsageError, match=r"the test suite needs trl \(setup.py's `test` extra\): run "
                                                    r"`pip install -e \.\[test\]`"):
            conftest.pytest_sessionstart(session(*args))
    # named files only (the GPU proof's kernel tests on a machine without the extra): not held to it
    conftest.pytest_sessionstart(session("tests/kernels/test_self_check.py::test_x",
                                         "tests/kernels/test_fused_adam.py"))
    monkeypatch.setattr(importlib.util, "find_spec", real)
    conftest.pytest_sessionstart(session("tests"))  # control: all there, no error


def _collected(*args) -> int:
    done = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    found = re.search(r"(\d+)(?:/\d+)? tests? collected", done.stdout)
    assert found or "no tests collected" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    return int(found.group(1)) if found else 0


@pytest.mark.slow  # three pytest collections in fresh processes
def test_markers_select_what_they_say():
    launches = os.path.join("tests", "distributed", "test_teardown.py")  # every test there launches ranks
    assert _collected("-m", "multi_rank", launches) > 0
    assert _collected("-m", "not multi_rank", launches) == 0
    no_ranks = os.path.join("tests", "unit", "test_state_layout.py")
    assert _collected("-m", "multi_rank", no_ranks) == 0  # control: no ranks


# ---- the layout ------------------------------------------------------------------------------------------------------

KINDS = ("unit", "kernels", "distributed", "tools", "gpu")  # tests/<kind>/test_*.py
LAUNCH_CALLS = ("torchrun", "run_ranks", "accelerate_launch")  # the suite's ways of starting several ranks
LAUNCHERS = ("torch.distributed.run", "deepspeed.launcher", "accelerate.commands.launch",  # `python -m` launchers
             "--num_processes",  # a command that launches through accelerate (a framework's own CLI: trl sft)
             "FORCE_TORCHRUN",  # LLaMA-Factory's switch that makes llamafactory-cli start torchrun
             "--nproc_per_node")  # torchrun's option, passed on by a framework's CLI (axolotl train)

OUTSIDE_KINDS = "a test module outside the kind folders"
DUPLICATE = "a test module whose name another test module has"
SECOND_CONFTEST = "a conftest.py besides tests/conftest.py"
LOOSE_HELPER = "a helper outside tests/support/"
LAUNCH_UNMARKED = "launches ranks without declaring pytestmark multi_rank"
LAUNCH_ELSEWHERE = "launches ranks outside tests/distributed/"
DISTRIBUTED_UNMARKED = "in tests/distributed/ without declaring pytestmark multi_rank"
CUDA_UNMARKED = "skips without CUDA but declares no gpu mark"
EXAMPLES_PATH = "puts examples/ on sys.path"
EXAMPLES_IMPORT = "imports a module of examples/"
TEST_IMPORT = "imports a test module"
BARE_SUPPORT = "imports a module of tests/support/ by its bare name"


def _docstrings(tree) -> set:
    """The docstring constants of a module, its classes and functions."""
    owners = [tree] + [node for node in ast.walk(tree)
                       if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    return {id(o.body[0].value) for o in owners
            if o.body and isinstance(o.body[0], ast.Expr) and isinstance(o.body[0].value, ast.Constant)}


def _launches(tree, examples: str) -> list:
    """How a module starts several ranks, as written in its functions: the suite's launch helpers, a launcher's name
    in a command (docstrings and module-level data aside), the scenario_results fixture, an example that launches."""
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    code = {id(node) for function in functions for node in ast.walk(function)} - _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in LAUNCH_CALLS or (name == "run_or_fail" and any(k.arg == "ranks" for k in node.keywords)):
                found.append(f"{name}()")
            script = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
            if name == "load" and ast.unparse(node.func) == "examples.load" and isinstance(script, str):
                with open(os.path.join(examples, f"{script}.py")) as f:  # an example script it drives in-process
                    found += [f"examples/{script}.py: {how}" for how in _launches(ast.parse(f.read()), examples)]
            if name == "Job":  # a background job running a support script that launches
                support = os.path.join(os.path.dirname(examples), "tests", "support")
                for part in ast.walk(node):
                    if isinstance(part, ast.Constant) and isinstance(part.value, str) and \
                            os.path.isfile(os.path.join(support, part.value)):
                        with open(os.path.join(support, part.value)) as f:
                            found += [f"tests/support/{part.value}: {how}"
                                      for how in _launches(ast.parse(f.read()), examples)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) in code:
            found += [launcher for launcher in LAUNCHERS if launcher in node.value]
        elif isinstance(node, ast.arg) and node.arg == "scenario_results":
            found.append("the scenario_results fixture")
    return found


def _pytestmark(tree) -> str:
    """The module's `pytestmark`, as written ("" without one)."""
    return next((ast.unparse(node.value) for node in tree.body if isinstance(node, ast.Assign)
                 and any(getattr(target, "id", None) == "pytestmark" for target in node.targets)), "")


def _imports(tree):
    """(top-level module name, line) of every absolute import, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name.split(".")[0], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.module.split(".")[0], node.lineno


def _path_edits(tree):
    """(statement, line) of every change to sys.path: insert, append, extend, an assignment to it or a slice of it."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("insert", "append", "extend") and ast.unparse(node.func.value) == "sys.path":
            yield ast.unparse(node), node.lineno
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(ast.unparse(target).startswith("sys.path") for target in targets):
                yield ast.unparse(node), node.lineno


def _skips_without_cuda(tree) -> bool:
    """Whether the module skips a test where no CUDA device is: a skipif on torch.cuda.is_available(), or the kernel
    harness's needs_cuda."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "needs_cuda":
            return True
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("mark.skipif") \
                and "cuda.is_available()" in ast.unparse(node):
            return True
    return False


def layout_problems(root: str) -> list:
    """Every break of the layout rules (this module's docstring) in the repository at `root`: (path, rule, detail)."""
    tests, examples = os.path.join(root, "tests"), os.path.join(root, "examples")
    example_modules = {name[:-3] for name in os.listdir(examples) if name.endswith(".py")}
    support_modules = {name[:-3] for name in os.listdir(os.path.join(tests, "support"))
                       if name.endswith(".py") and name != "__init__.py"}
    problems, test_names = [], {}
    for path in [path for folder in (tests, os.path.join(root, "benchmarks"), os.path.join(root, "tools"))
                 for path in python_files(folder)]:
        rel = os.path.relpath(path, root)
        with open(path) as f:
            tree = ast.parse(f.read(), rel)
        problems += [(rel, EXAMPLES_IMPORT, f"line {line}: {name}") for name, line in _imports(tree)
                     if name in example_modules]
        problems += [(rel, EXAMPLES_PATH, f"line {line}: {code}") for code, line in _path_edits(tree)
                     if "examples" in code.lower()]
        parts = rel.split(os.sep)
        if parts[0] != "tests":
            continue
        for name, line in _imports(tree):
            if name.startswith("test_"):
                problems.append((rel, TEST_IMPORT, f"line {line}: {name} (what tests share lives in tests/support)"))
            elif name in support_modules:
                problems.append((rel, BARE_SUPPORT, f"line {line}: {name} (import support.{name})"))
        test = parts[-1].startswith("test_")
        if parts[1] == "support" or rel == os.path.join("tests", "conftest.py") or \
                (parts[1] == "gpu" and len(parts) == 3 and not test):  # the GPU proof, beside its test
            continue
        if not test:
            problems.append((rel, SECOND_CONFTEST if parts[-1] == "conftest.py" else LOOSE_HELPER, ""))
            continue
        if len(parts) != 3 or parts[1] not in KINDS:
            problems.append((rel, OUTSIDE_KINDS, f"tests/{{{','.join(KINDS)}}}/"))
            continue
        if parts[-1] in test_names:
            problems.append((rel, DUPLICATE, test_names[parts[-1]]))
        test_names.setdefault(parts[-1], rel)
        launches, marked = _launches(tree, examples), "pytest.mark.multi_rank" in _pytestmark(tree)
        if launches and not marked:
            problems.append((rel, LAUNCH_UNMARKED, ", ".join(launches)))
        if launches and parts[1] not in ("distributed", "gpu"):
            problems.append((rel, LAUNCH_ELSEWHERE, ", ".join(launches)))
        if parts[1] == "distributed" and not marked:
            problems.append((rel, DISTRIBUTED_UNMARKED, ""))
        if _skips_without_cuda(tree) and "pytest.mark.gpu" not in ast.unparse(tree):
            problems.append((rel, CUDA_UNMARKED, ""))
    return problems


def test_the_suite_keeps_its_layout():
    assert layout_problems(ROOT) == []


def test_every_launching_module_is_seen_launching():
    """The detection itself, on the suite: each module of tests/distributed/ and the GPU proof's rehearsal launch
    ranks by one of the ways the rules name (so a new way of launching shows up here first); no unit test does."""
    launching = set()
    for path in python_files(os.path.join(ROOT, "tests")):
        if os.path.basename(path).startswith("test_"):
            with open(path) as f:
                if _launches(ast.parse(f.read()), os.path.join(ROOT, "examples")):
                    launching.add(os.path.relpath(path, ROOT))
    expected = {os.path.relpath(path, ROOT) for path in python_files(os.path.join(ROOT, "tests", "distributed"))}
    assert launching == expected | {os.path.join("tests", "gpu", "test_gpu_proof.py")}


# one file per rule broken, and files that keep them all (controls)
BROKEN_TREE = {
    "examples/train.py": "",
    "examples/elastic_failover.py": "import subprocess\n\n\ndef run():\n"
                                    "    subprocess.run(['python', '-m', 'torch.distributed.run'])\n",
    "tests/conftest.py": "",
    "tests/support/__init__.py": "",
    "tests/support/toy.py": "import os, sys\nsys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))\n",
    "tests/unit/test_fine.py": 'import pytest\nfrom support.toy import x\n\n\ndef test_x():\n'
                               '    """Names torch.distributed.run in its docstring only."""\n',
    "tests/distributed/test_marked.py": "import pytest\nfrom conftest import torchrun\n\npytestmark = "
                                        "[pytest.mark.multi_rank]\n\n\ndef test_x():\n"
                                        "    torchrun('support/x.py', 2)\n",
    "tests/kernels/test_gpu_marked.py": "import pytest, torch\n\n\n@pytest.mark.gpu\n@pytest.mark.skipif(not "
                                        "torch.cuda.is_available(), reason='no CUDA')\ndef test_x():\n    pass\n",
    "tests/gpu/proof.py": "",
    "tests/test_flat.py": "",
    "tests/helper.py": "",
    "tests/unit/conftest.py": "",
    "tests/unit/test_launch.py": "from conftest import run_or_fail\n\n\ndef test_x():\n    run_or_fail([], {}, 60, "
                                 "ranks=2)\n",
    "tests/kernels/test_scenarios.py": "import pytest\n\npytestmark = pytest.mark.slow\n\n\n"
                                       "def test_x(scenario_results):\n    pass\n",
    "tests/tools/test_failover.py": "import pytest\nfrom support import examples\n\npytestmark = pytest.mark.multi_rank"
                                    "\n\n\ndef test_x():\n    examples.load('elastic_failover').run()\n",
    "tests/distributed/test_unmarked.py": "def test_x():\n    pass\n",
    "tests/tools/test_examples.py": "import os, sys\nsys.path.insert(0, os.path.join('..', 'examples'))\n",
    "tests/tools/test_train.py": "def test_x():\n    import train\n",
    "tests/kernels/test_imports.py": "import toy\nfrom test_fine import x\n",
    "tests/kernels/test_cuda.py": "import pytest, torch\n\n\n@pytest.mark.skipif(not torch.cuda.is_available(), "
                                  "reason='no CUDA')\ndef test_x():\n    pass\n",
    "tests/tools/test_cuda.py": "",  # the name of a kernels test
    "benchmarks/bench.py": "from train import main\n",
    "tools/tool.py": "import sys\nsys.path[:0] = ['examples']\n",
}


def test_control_each_broken_rule_is_flagged(tmp_path):
    for rel, text in BROKEN_TREE.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = sorted((rel.replace(os.sep, "/"), rule) for rel, rule, _ in layout_problems(str(tmp_path)))
    assert found == sorted([
        ("tests/test_flat.py", OUTSIDE_KINDS), ("tests/helper.py", LOOSE_HELPER),
        ("tests/unit/conftest.py", SECOND_CONFTEST),
        ("tests/unit/test_launch.py", LAUNCH_UNMARKED), ("tests/unit/test_launch.py", LAUNCH_ELSEWHERE),
        ("tests/kernels/test_scenarios.py", LAUNCH_UNMARKED), ("tests/kernels/test_scenarios.py", LAUNCH_ELSEWHERE),
        ("tests/tools/test_failover.py", LAUNCH_ELSEWHERE),  # marked, but not where launches live
        ("tests/distributed/test_unmarked.py", DISTRIBUTED_UNMARKED),
        ("tests/tools/test_examples.py", EXAMPLES_PATH), ("tests/tools/test_train.py", EXAMPLES_IMPORT),
        ("tests/kernels/test_imports.py", BARE_SUPPORT), ("tests/kernels/test_imports.py", TEST_IMPORT),
        ("tests/kernels/test_cuda.py", CUDA_UNMARKED), ("tests/tools/test_cuda.py", DUPLICATE),
        ("benchmarks/bench.py", EXAMPLES_IMPORT), ("tools/tool.py", EXAMPLES_PATH)])


def test_every_background_job_has_a_fixture_of_its_name():
    """A job starts early only where a collected test uses the fixture named after it (support/background.py): the
    suite's modules all name theirs so, and a module that does not is refused at collection. Control: a job whose
    fixture has another name (how a killed-build job once ran last, after its test had waited 111 s for it)."""
    import types
    from support import background
    for path in python_files(os.path.join(ROOT, "tests")):
        with open(path) as f:
            source = f.read()
        if re.search(r"^BACKGROUND_JOBS = ", source, re.M):
            jobs = re.findall(r'background\.Job\(\s*"(\w+)"', source) + re.findall(r'_script\(\s*"(\w+)"', source)
            assert jobs and all(re.search(rf"^def {name}\(", source, re.M) for name in jobs), (path, jobs)

    def module(fixture_name):
        fake = types.ModuleType("test_fake")
        fake.BACKGROUND_JOBS = (background.Job("the_job", lambda folder: [], dict, 1),)
        setattr(fake, fixture_name, lambda: None)
        return fake
    assert background.unnamed_jobs(module("the_job")) == []
    assert background.unnamed_jobs(module("another_name")) == [
        "test_fake: background job 'the_job' has no fixture of its name in the module"]
    with pytest.raises(ValueError, match="background job 'the_job' has no fixture of its name"):
        background.start_for([types.SimpleNamespace(module=module("another_name"), fixturenames=())])
