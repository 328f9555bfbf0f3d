"""The override register (overrides.py) is true of the installed DeepSpeed release, and complete.

- every entry that exists in this release resolves, with the parameters it lists in that order, and every parameter
  or symbol marked `since` a later release is absent (so the release differences written there are facts);
- every DeepSpeed method that deepspeed_bnb's ZeRO classes override is registered as such;
- no module of the package assigns to a DeepSpeed or Accelerate module or class except through the register;
- `stock_deepspeed()` takes back every replacement, `swapped()` restores what it swapped;
- the table in docs/overrides.md is exactly the register's: the whole text between its markers, compared.
The compatibility matrix runs this file against every supported DeepSpeed release. Controls: a made-up entry, a
parameter that does not exist, an unregistered override, and a table section with one extra line are reported.
"""

import ast
import inspect
import os

import deepspeed
import pytest
from packaging.version import Version

import deepspeed_bnb  # noqa: F401  (activates the overrides)
from conftest import TESTS
from support.sources import python_files
from deepspeed_bnb import installer, overrides
from deepspeed_bnb.overrides import OVERRIDES, Override
from deepspeed_bnb.runtime.zero.stage3 import BnbZeroStage3Optimizer
from deepspeed_bnb.runtime.zero.stage_1_and_2 import BnbZeroOptimizer

ROOT = os.path.dirname(TESTS)
PACKAGE = os.path.join(ROOT, "deepspeed_bnb")
INSTALLED = Version(Version(deepspeed.__version__).base_version)


def _assigned_in_source(cls, name: str) -> bool:
    """Whether DeepSpeed's class assigns `self.<name>` somewhere (an instance attribute relied on)."""
    return any(f"self.{name} =" in inspect.getsource(klass) or f"self.{name}:" in inspect.getsource(klass)
               for klass in cls.__mro__ if klass.__module__.startswith("deepspeed."))


def problems_with(entry: Override, release=INSTALLED) -> list:
    """What is untrue of `entry` for the installed DeepSpeed (empty: all of it holds)."""
    if entry.trigger and entry.owner.split(".")[0] != "deepspeed":
        pytest.importorskip(entry.owner.split(".")[0])
    try:
        owner = overrides.resolve(entry.owner)
    except (ImportError, AttributeError) as exc:
        return [f"{entry.key}: owner {entry.owner} does not resolve ({exc})"]
    exists = entry.exists_in(str(release))
    stock = installer._STOCK.get(entry.key)
    present = hasattr(owner, entry.name) or (inspect.isclass(owner) and _assigned_in_source(owner, entry.name))
    if present != exists:
        return [f"{entry.key}: {'missing' if exists else 'present, though registered since ' + entry.since}"]
    if not exists or entry.params is None:
        return []
    symbol = stock if stock is not None else getattr(owner, entry.name, None)
    if symbol is None or not callable(symbol):
        return [f"{entry.key}: not a callable"]
    found = overrides.parameters(symbol)
    problems = []
    position = 0
    for name in entry.params:
        if name not in found[position:]:
            problems.append(f"{entry.key}: parameter {name!r} not found in order in {found}")
            break
        position = found.index(name, position) + 1
    for name, since in entry.params_since.items():
        if (name in found) != (release >= Version(since)):
            problems.append(f"{entry.key}: parameter {name!r} registered since {since}, "
                            f"{'absent' if name not in found else 'present'} in {release}")
    return problems


@pytest.mark.parametrize("entry", OVERRIDES, ids=lambda o: o.key)
def test_entry_is_true_of_the_installed_release(entry):
    assert problems_with(entry) == []


def test_control_untrue_entries_are_reported():
    made_up = Override("deepspeed.runtime.engine.DeepSpeedEngine", "no_such_method", overrides.CALL,
                       overrides.CALL_SCOPE, "", "control", ("self",))
    assert problems_with(made_up) == ["DeepSpeedEngine.no_such_method: missing"]
    wrong_param = Override("deepspeed.runtime.engine.DeepSpeedEngine", "save_checkpoint", overrides.CALL,
                           overrides.CALL_SCOPE, "", "control", ("self", "no_such_parameter"))
    assert "parameter 'no_such_parameter' not found" in problems_with(wrong_param)[0]
    too_late = Override("deepspeed.runtime.engine.DeepSpeedEngine", "load_checkpoint", overrides.CALL,
                        overrides.CALL_SCOPE, "", "control", ("self",), since=f"{INSTALLED.major + 1}.0.0")
    assert "present, though registered since" in problems_with(too_late)[0]
    late_param = Override("deepspeed.runtime.engine.DeepSpeedEngine", "load_checkpoint", overrides.CALL,
                          overrides.CALL_SCOPE, "", "control", ("self",),
                          params_since={"tag": f"{INSTALLED.major + 1}.0.0"})
    assert "registered since" in problems_with(late_param)[0]


def _unregistered_overrides(ours, base) -> list:
    registered = {o.name for o in OVERRIDES if o.how == overrides.SUBCLASS and o.owner.endswith(base.__name__)}
    found = []
    for klass in ours.__mro__[:ours.__mro__.index(base)]:
        if not klass.__module__.startswith("deepspeed."):  # ours (mixins included), not DeepSpeed's own bases
            found += [name for name, value in vars(klass).items() if callable(value) and hasattr(base, name)
                      and name not in registered]
    return sorted(set(found))


@pytest.mark.parametrize("ours", [BnbZeroOptimizer, BnbZeroStage3Optimizer], ids=lambda c: c.__name__)
def test_every_overridden_deepspeed_method_is_registered(ours):
    base = next(k for k in ours.__mro__ if k.__module__.startswith("deepspeed."))
    assert _unregistered_overrides(ours, base) == []


def test_control_an_unregistered_override_is_found():
    class Sneaky(BnbZeroOptimizer):
        def reduce_gradients(self, *args, **kwargs):  # a DeepSpeedZeroOptimizer method the register does not list
            return None

    base = next(k for k in Sneaky.__mro__ if k.__module__.startswith("deepspeed."))
    assert _unregistered_overrides(Sneaky, base) == ["reduce_gradients"]


def _foreign_assignments(path: str) -> list:
    """`X.attr = ...` and `setattr(X, ...)` where X is a name bound to a DeepSpeed or Accelerate module or class."""
    tree = ast.parse(open(path).read())
    foreign = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            foreign.update((a.asname or a.name).split(".")[0] for a in node.names
                           if a.name.split(".")[0] in ("deepspeed", "accelerate"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("deepspeed",
                                                                                                 "accelerate"):
            foreign.update(a.asname or a.name for a in node.names)
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and \
                    target.value.id in foreign:
                found.append(ast.unparse(node))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and \
                isinstance(node.args[0], ast.Name) and node.args[0].id in foreign:
            found.append(ast.unparse(node))
    return found


def test_nothing_outside_the_register_patches_deepspeed():
    offenders = {}
    for path in python_files(PACKAGE):
        if path != inspect.getsourcefile(overrides):
            found = _foreign_assignments(path)
            if found:
                offenders[os.path.relpath(path, ROOT)] = found
    assert offenders == {}


def test_control_a_patch_outside_the_register_is_found(tmp_path):
    path = tmp_path / "sneaky.py"
    path.write_text("import deepspeed.runtime.zero.stage3 as ds_stage3\nfrom deepspeed.runtime import engine\n"
                    "ds_stage3.reduce_scatter_coalesced = None\nsetattr(engine, 'x', 1)\n")
    assert len(_foreign_assignments(str(path))) == 2


def test_stock_deepspeed_takes_back_every_replacement():
    entries = installer.installed_entries()
    assert installer.is_active() and entries
    ours = {o.key: overrides.resolve(o.replacement) for o in entries}
    for entry in entries:
        assert getattr(overrides.resolve(entry.owner), entry.name) is ours[entry.key], entry.key
    with installer.stock_deepspeed():
        for entry in entries:
            current = getattr(overrides.resolve(entry.owner), entry.name)
            assert current is installer.stock(entry.key) and current is not ours[entry.key], entry.key
    for entry in entries:
        assert getattr(overrides.resolve(entry.owner), entry.name) is ours[entry.key], entry.key


def test_swapped_restores_and_refuses_unregistered_swaps():
    class Engine:
        def load(self, path, map_location=None):
            return "class"

    engine = Engine()
    with installer.swapped("CheckpointEngine.load", lambda path, map_location=None: "swapped", on=engine):
        assert engine.load("x") == "swapped"
    assert engine.load("x") == "class" and "load" not in vars(engine)  # the class's method shows through again
    with pytest.raises(ValueError, match="not a call-scope swap"):
        with installer.swapped("DeepSpeedEngine.save_checkpoint", None):
            pass


DOC_BEGIN, DOC_END = "<!-- overrides: begin (tools/render_overrides.py) -->", "<!-- overrides: end -->"


def table_section_problem(text: str, table: str) -> str:
    """Why the text between the markers in `text` is not exactly `table` on lines of its own ("" when it is)."""
    if text.count(DOC_BEGIN) != 1 or text.count(DOC_END) != 1:
        return f"expected exactly one {DOC_BEGIN} and one {DOC_END} marker"
    found = text.split(DOC_BEGIN, 1)[1].split(DOC_END, 1)[0]
    expected = f"\n{table}\n"
    if found == expected:
        return ""
    got, want = found.split("\n"), expected.split("\n")
    line = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return (f"the section differs from the register's table at its line {line}: "
            f"{(got[line] if line < len(got) else '<end>')!r} instead of "
            f"{(want[line] if line < len(want) else '<end>')!r}")


def test_docs_table_is_the_register():
    with open(os.path.join(ROOT, "docs", "overrides.md")) as f:
        text = f.read()
    problem = table_section_problem(text, overrides.table())
    assert problem == "", f"docs/overrides.md: {problem}; run `python tools/render_overrides.py`"


def test_control_a_section_with_an_extra_line_is_reported():
    table = overrides.table()
    clean = f"intro\n{DOC_BEGIN}\n{table}\n{DOC_END}\nafter\n"
    assert table_section_problem(clean, table) == ""
    log = "[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU."
    logged = clean.replace(f"{DOC_BEGIN}\n", f"{DOC_BEGIN}\n{log}\n")
    assert table in logged  # a substring check would not see it
    assert "at its line 1: '[WARNING]" in table_section_problem(logged, table)
    assert "line" in table_section_problem(clean.replace(table, table + "\n| stale row |"), table)
    assert "marker" in table_section_problem(clean.replace(DOC_END, ""), table)
