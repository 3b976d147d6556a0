"""scripts/transformers_internals.py: its list covers every transformers internal the package reads (compat.py's
imports and attributes, the architecture table's transformers rows), and its comparison tells unchanged, changed
(signature), changed (source), missing and new apart, on two small fake transformers folders (offline: downloading
the real wheels is run by hand, and by tests-transformers-next)."""

import ast
import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

from hf_statecompose.state import architectures

ROOT = Path(__file__).resolve().parents[1]
COMPAT = ROOT / "hf_statecompose" / "compat.py"
_spec = importlib.util.spec_from_file_location("transformers_internals", ROOT / "scripts" / "transformers_internals.py")
internals = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = internals  # its dataclass looks its module up there
_spec.loader.exec_module(internals)


# ------------------------------------------------------------------------------------------ what compat.py reads
def _transformers_names(source: str) -> tuple[set[str], set[str], dict[str, set[str]]]:
    """(imported names and attributes read, e.g. transformers.cache_utils.DummyLayer; module paths named in strings;
    {transformers class a class in the file subclasses: the methods it overrides})."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> transformers path
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "transformers":
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                names.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "transformers":
                    aliases[alias.asname or alias.name] = alias.name
                    names.add(alias.name)

    def path_of(node) -> str | None:
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        # importlib.import_module("transformers.x")
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("transformers.")
        ):
            return node.args[0].value
        return None

    strings: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (base := path_of(node.value)):
            names.add(f"{base}.{node.attr}")
        elif (  # getattr(module, "Name", ...)
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "getattr"
            and len(node.args) >= 2
            and (base := path_of(node.args[0]))
            and isinstance(node.args[1], ast.Constant)
        ):
            names.add(f"{base}.{node.args[1].value}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("transformers."):
            if "{" not in node.value and " " not in node.value:  # a module's name, not a template or prose
                strings.add(node.value)
    overrides: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                if isinstance(base, ast.Name) and base.id in aliases:
                    methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                    overrides.setdefault(aliases[base.id], set()).update(methods)
    return names, strings, overrides


def _covered(name: str) -> bool:
    """`name` is listed, is a module some listed name lies in, or is a method of a listed class (``DynamicLayer.crop``:
    the class's row compares its methods)."""
    parts = name.split(".")
    return any(key.startswith(f"{name}.") for key in internals.INTERNALS) or any(
        ".".join(parts[:end]) in internals.INTERNALS for end in range(2, len(parts) + 1)
    )


def test_the_list_covers_every_transformers_name_that_compat_reads():
    names, strings, overrides = _transformers_names(COMPAT.read_text(encoding="utf-8"))
    # what this parser must find in today's compat.py: if it finds less, the parser (not compat) is out of date
    assert {
        "transformers.cache_utils.LinearAttentionLayer",
        "transformers.cache_utils.DynamicLayer",
        "transformers.cache_utils.DummyLayer",
        "transformers.cache_utils.Cache",
        "transformers.generation.GenerationMixin",
        "transformers.utils.deprecation.deprecate_kwarg",
        "transformers.utils.logging.disable_progress_bar",
    } <= names
    assert "transformers.integrations.hub_kernels" in strings
    missing = sorted(name for name in names | strings if not _covered(name))
    assert not missing, (
        f"compat.py reads {missing}, which scripts/transformers_internals.py's INTERNALS does not list: add each, "
        "as 'transformers.<module>.<name>': '<file under transformers/>:<name>'"
    )
    for base, methods in overrides.items():
        # a compat class that overrides a transformers class's methods: the class is compared as a whole, and each
        # overridden generation hook also on its own (GenerationMixin is large: its own row changes nearly always)
        assert base in internals.INTERNALS, f"compat.py subclasses {base}: list it in INTERNALS"
        if base == "transformers.generation.GenerationMixin":
            unlisted = sorted(
                m for m in methods if not m.startswith("_hsc") and f"{base}.{m}" not in internals.INTERNALS
            )
            assert not unlisted, f"compat.py overrides {base}'s {unlisted}: list each in INTERNALS"


def test_the_list_covers_every_transformers_row_of_the_architecture_table():
    rows = [row for row in architectures.ARCHITECTURES.values() if not row.is_own]
    assert len(rows) >= 10
    unlisted = sorted(
        f"{row.model_module}.{name}"
        for row in rows
        for name in (row.mixer_class, *row.model_classes)
        if name is not None and f"{row.model_module}.{name}" not in internals.INTERNALS
    )
    assert not unlisted, f"the architecture table names {unlisted}: add them to INTERNALS (its _modeling(...) lines)"


def test_every_listed_location_is_a_file_and_a_qualified_name():
    for name, location in internals.INTERNALS.items():
        file, _, qualname = location.partition(":")
        assert file.endswith(".py") and qualname and name.endswith(qualname.rsplit(".", 1)[-1]), (name, location)


# ------------------------------------------------------------------------------------------ the comparison
OLD = '''
    import torch

    def same(x, y=1):
        """A docstring."""
        return x + y  # a comment

    def renamed(x, cache_params=None):
        return cache_params

    def body(x):
        return x + 1

    def gone():
        pass

    if torch.cuda.is_available():
        def conditional():
            return 1
    else:
        def conditional():
            return 2

    class Layer:
        def __init__(self, n):
            self.n = n

        def step(self, x):
            return x

    class Mixer:
        def forward(self, hidden, cache_params=None):
            return hidden
'''
NEW = '''
    import torch

    def same(x, y=1):
        """Another docstring, and another layout."""
        return (
            x + y
        )

    def renamed(x, cache=None):
        return cache

    def body(x):
        return x + 2

    def added():
        pass

    if torch.cuda.is_available():
        def conditional():
            return 1
    else:
        def conditional():
            return 3

    class Layer:
        def __init__(self, n):
            self.n = n

        def step(self, x):
            return x * 2

        def count(self):
            return 0

    class Mixer:
        def forward(self, hidden, cache=None):
            return hidden
'''
FAKE = {
    "t.same": "utils/mod.py:same",
    "t.renamed": "utils/mod.py:renamed",
    "t.body": "utils/mod.py:body",
    "t.gone": "utils/mod.py:gone",
    "t.added": "utils/mod.py:added",
    "t.conditional": "utils/mod.py:conditional",
    "t.Layer": "utils/mod.py:Layer",
    "t.Layer.__init__": "utils/mod.py:Layer.__init__",
    "t.Layer.step": "utils/mod.py:Layer.step",
    "t.Mixer": "utils/mod.py:Mixer",
    "t.nowhere": "utils/absent.py:nowhere",
}


def _release(root: Path, source: str) -> Path:
    module = root / "transformers" / "utils" / "mod.py"
    module.parent.mkdir(parents=True)
    module.write_text(textwrap.dedent(source))
    return root


@pytest.fixture
def releases(tmp_path):
    return _release(tmp_path / "5.98.0", OLD), _release(tmp_path / "5.99.0", NEW)


def test_compare_tells_each_kind_of_change_apart(releases):
    rows = {row.name: row for row in internals.compare(*releases, internals=FAKE)}
    assert {name: row.status for name, row in rows.items()} == {
        "t.same": "unchanged",  # docstring, comment and layout do not count
        "t.renamed": "changed (signature)",
        "t.body": "changed (source)",
        "t.gone": "missing",
        "t.added": "new",
        "t.conditional": "changed (source)",  # the def under `else:` changed
        "t.Layer": "changed (signature)",  # a method was added
        "t.Layer.__init__": "unchanged",
        "t.Layer.step": "changed (source)",
        "t.Mixer": "changed (signature)",  # forward(cache_params) -> forward(cache), transformers 5.24's rename
        "t.nowhere": "missing",
    }
    assert rows["t.renamed"].detail == "+cache = None; -cache_params"
    assert rows["t.Mixer"].detail == "signature: forward (+cache = None; -cache_params)"
    assert "changed: step" in rows["t.Layer"].detail and "added: count" in rows["t.Layer"].detail
    assert "in neither" in rows["t.nowhere"].detail


def test_the_command_prints_a_table_or_json_from_extracted_folders(releases, capsys):
    folder = releases[0].parent
    assert internals.main(["5.99.0", "--baseline", "5.98.0", "--from-dir", str(folder)]) == 0
    table = capsys.readouterr().out
    assert table.startswith("transformers 5.99.0 against 5.98.0")
    assert "transformers.cache_utils.DynamicCache" in table and "missing" in table
    assert internals.main(["5.99.0", "--baseline", "5.98.0", "--from-dir", str(folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["version"], report["baseline"]) == ("5.99.0", "5.98.0")
    assert {row["name"] for row in report["rows"]} == set(internals.INTERNALS)
    assert internals.main(["5.99.0", "--baseline", "5.98.0", "--from-dir", str(folder), "--fail-on-change"]) == 1
    capsys.readouterr()
    assert internals.main(["5.99.1", "--baseline", "5.98.0", "--from-dir", str(folder)]) == 2
    assert "holds no transformers folder" in capsys.readouterr().err


def test_the_default_baseline_is_the_newest_tested_release(tmp_path):
    low, high = internals.tested_range()
    assert (low, high) == tuple(ast.literal_eval(_tested_literal()))
    for version in (f"{low}.0", f"{low}.1", f"{high}.0", "not-a-version"):
        (tmp_path / version / "transformers").mkdir(parents=True)
    assert internals.default_baseline(tmp_path) == (f"{low}.1", tmp_path / f"{low}.1")  # the highest below `high`


def _tested_literal() -> str:
    text = COMPAT.read_text(encoding="utf-8")
    return text.split("TESTED_TRANSFORMERS = ", 1)[1].splitlines()[0]


def test_a_cached_wheel_is_read_without_the_network(tmp_path, monkeypatch):
    (tmp_path / "5.98.0" / "transformers").mkdir(parents=True)

    def no_pip(*args, **kwargs):
        raise AssertionError("pip was called for a cached release")

    monkeypatch.setattr(internals.subprocess, "run", no_pip)
    assert internals.wheel_folder("==5.98.0", cache=tmp_path) == ("5.98.0", tmp_path / "5.98.0")
