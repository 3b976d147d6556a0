"""Which of transformers' internals that hf_statecompose reads changed between two releases.

    python scripts/transformers_internals.py 5.26.0                   # against the newest tested release
    python scripts/transformers_internals.py 5.25.0 --baseline 5.24.0
    python scripts/transformers_internals.py installed                # the transformers installed beside this Python
    python scripts/transformers_internals.py 5.25.0 --from-dir /tmp/tw --json

hf_statecompose reads transformers' cache layers, its generation hooks, its deprecation wrapper, its logging and
kernel-fallback notices, and the mixer and model classes of every architecture in its table
(``hf_statecompose/compat.py``, ``hf_statecompose/state/architectures.py``); :data:`INTERNALS` lists them. For each,
this compares the definition in the two releases' wheels (the source of the ``def`` / ``class``, parsed, not
imported: no torch needed) and prints one of

* ``unchanged``: the same code (docstrings, comments and layout aside);
* ``changed (signature)``: a function's parameters or return annotation differ, or a class's bases or the
  signature of one of its own methods (the detail names them; the source differs too);
* ``changed (source)``: same signature, different code (for a class: the methods that differ are named);
* ``missing``: in the baseline, not in the new release (or in neither);
* ``new``: in the new release only.

A change is a place to read, not necessarily a break: the tests (``python -m nox -s tests-transformers-next``) say
whether the package still works. The baseline defaults to the newest tested release: the highest release below
the first untested one, ``compat.TESTED_TRANSFORMERS[1]`` (read from compat.py's text, so nothing of the package
or of transformers is imported).

Wheels come from PyPI (``pip download --no-deps``, this Python's pip and its configuration) and are kept, extracted,
in ~/.cache/hf_statecompose/transformers-wheels/<version>/. ``--from-dir DIR`` reads DIR/<version>/transformers
instead (no network). The comparison itself, :func:`compare`, takes two folders that each hold a ``transformers``
package, which is what the tests give it.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / "hf_statecompose" / "compat.py"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hf_statecompose" / "transformers-wheels"


def _modeling(folder: str, *classes: str) -> dict[str, str]:
    """The classes of transformers' model `folder` (compat.modeling_module's layout)."""
    module = f"models/{folder}/modeling_{folder}.py"
    return {f"transformers.models.{folder}.modeling_{folder}.{name}": f"{module}:{name}" for name in classes}


# {the name as the package reads it: "file under transformers/:qualified name in that file"}. The file is where the
# name is defined, which differs from the import path for re-exports (transformers.generation.GenerationMixin lives
# in generation/utils.py). tests/test_transformers_internals.py checks that this covers every transformers name that
# compat.py reads and every transformers row of the architecture table: a name added there must be added here.
INTERNALS: dict[str, str] = {
    # the cache layers that compat's SSMLayerBase / AttentionLayerBase / SSMAttentionLayerBase / EmptyLayer subclass
    # or reuse, and the caches that hold them (their methods call the layers' batch operations, crop, counters)
    "transformers.cache_utils.CacheLayerMixin": "cache_utils.py:CacheLayerMixin",
    "transformers.cache_utils.DynamicLayer": "cache_utils.py:DynamicLayer",
    "transformers.cache_utils.LinearAttentionCacheLayerMixin": "cache_utils.py:LinearAttentionCacheLayerMixin",
    "transformers.cache_utils.LinearAttentionLayer": "cache_utils.py:LinearAttentionLayer",
    "transformers.cache_utils.LinearAttentionAndFullAttentionLayer": (
        "cache_utils.py:LinearAttentionAndFullAttentionLayer"
    ),
    "transformers.cache_utils.DummyLayer": "cache_utils.py:DummyLayer",
    "transformers.cache_utils.Cache": "cache_utils.py:Cache",
    "transformers.cache_utils.DynamicCache": "cache_utils.py:DynamicCache",
    # the generation hooks that compat's CacheGenerationMixin overrides, and the paths that call the caches' layers
    # (assisted generation crops them); the class as a whole too (its other methods are what generate() runs)
    "transformers.generation.GenerationMixin": "generation/utils.py:GenerationMixin",
    # generate() itself: compat's CacheGenerationMixin refuses assisted generation before it, with its signature
    "transformers.generation.GenerationMixin.generate": "generation/utils.py:GenerationMixin.generate",
    "transformers.generation.GenerationMixin._prepare_cache_for_generation": (
        "generation/utils.py:GenerationMixin._prepare_cache_for_generation"
    ),
    "transformers.generation.GenerationMixin.prepare_inputs_for_generation": (
        "generation/utils.py:GenerationMixin.prepare_inputs_for_generation"
    ),
    "transformers.generation.GenerationMixin._assisted_decoding": (
        "generation/utils.py:GenerationMixin._assisted_decoding"
    ),
    "transformers.generation.GenerationMixin._get_candidate_generator": (
        "generation/utils.py:GenerationMixin._get_candidate_generator"
    ),
    # compat.wrap_inside_deprecations reaches into the wrapper's closure (its `func` cell)
    "transformers.utils.deprecation.deprecate_kwarg": "utils/deprecation.py:deprecate_kwarg",
    # compat.quiet_kernel_fallbacks filters this function's notice by its text (compat.FALLBACK_NOTICE)
    "transformers.integrations.hub_kernels.use_kernel_func_from_hub_with_fallback": (
        "integrations/hub_kernels.py:use_kernel_func_from_hub_with_fallback"
    ),
    # compat.quiet_loading
    "transformers.utils.logging.is_progress_bar_enabled": "utils/logging.py:is_progress_bar_enabled",
    "transformers.utils.logging.enable_progress_bar": "utils/logging.py:enable_progress_bar",
    "transformers.utils.logging.disable_progress_bar": "utils/logging.py:disable_progress_bar",
    # compat.is_tracing copies its torch checks
    "transformers.utils.import_utils.is_tracing": "utils/import_utils.py:is_tracing",
    # the architecture table's transformers rows: the stock mixer that enable swaps, the models the guard wraps
    **_modeling("mamba", "MambaMixer", "MambaModel", "MambaForCausalLM"),
    **_modeling("falcon_mamba", "FalconMambaMixer", "FalconMambaModel", "FalconMambaForCausalLM"),
    **_modeling("mamba2", "Mamba2Mixer", "Mamba2Model", "Mamba2ForCausalLM"),
    **_modeling("bamba", "BambaMixer", "BambaModel", "BambaForCausalLM"),
    **_modeling(
        "granitemoehybrid", "GraniteMoeHybridMambaLayer", "GraniteMoeHybridModel", "GraniteMoeHybridForCausalLM"
    ),
    **_modeling("nemotron_h", "NemotronHMamba2Mixer", "NemotronHModel", "NemotronHForCausalLM"),
    **_modeling("falcon_h1", "FalconH1Mixer", "FalconH1Model", "FalconH1ForCausalLM"),
    **_modeling("zamba2", "Zamba2MambaMixer", "Zamba2Model", "Zamba2ForCausalLM"),
    **_modeling("jamba", "JambaMambaMixer", "JambaModel", "JambaForCausalLM"),
    **_modeling("qwen3_next", "Qwen3NextGatedDeltaNet", "Qwen3NextModel", "Qwen3NextForCausalLM"),
    **_modeling("qwen3_5", "Qwen3_5GatedDeltaNet", "Qwen3_5TextModel", "Qwen3_5ForCausalLM"),
    **_modeling("qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet", "Qwen3_5MoeTextModel", "Qwen3_5MoeForCausalLM"),
    **_modeling("olmo_hybrid", "OlmoHybridGatedDeltaNet", "OlmoHybridModel", "OlmoHybridForCausalLM"),
    **_modeling("kimi_linear", "KimiLinearDeltaAttention", "KimiLinearModel", "KimiLinearForCausalLM"),
}

STATUSES = ("unchanged", "changed (signature)", "changed (source)", "missing", "new")


@dataclasses.dataclass
class Row:
    name: str
    status: str
    detail: str = ""


# ------------------------------------------------------------------------------------------------ the comparison
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _definitions(body: list[ast.stmt], name: str) -> list[ast.stmt]:
    """The defs / classes called `name` in `body`, also those under `if` / `try` / `with` at that level (transformers
    defines some functions twice: with and without an optional package); not inside other defs."""
    found: list[ast.stmt] = []
    for node in body:
        if isinstance(node, _DEFS) and node.name == name:
            found.append(node)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, block, []):
                    found += _definitions(child.body if isinstance(child, ast.ExceptHandler) else [child], name)
    return found


def _lookup(tree: ast.Module, qualname: str) -> list[ast.stmt]:
    scopes: list[ast.stmt] = [tree]  # type: ignore[list-item]
    for part in qualname.split("."):
        scopes = [node for scope in scopes for node in _definitions(scope.body, part)]  # type: ignore[attr-defined]
    return scopes


def _without_docstrings(node: ast.stmt) -> ast.stmt:
    """A copy of `node` with the docstrings of it and of the defs inside it removed: a docstring edit is no change."""
    node = copy.deepcopy(node)
    for inner in ast.walk(node):
        body = getattr(inner, "body", None)
        if (
            isinstance(inner, _DEFS)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            inner.body = body[1:] or [ast.Pass()]
    return node


def _signature(node: ast.stmt) -> str:
    """A function's parameters and return annotation; a class's bases and the signatures of its own methods (what
    its callers and subclasses rely on: transformers 5.24 renamed the mixers' `forward(cache_params)` to `cache`)."""
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in [*node.bases, *node.keywords])
        methods = [f"{n.name}{_signature(n)}" for n in node.body if isinstance(n, _DEFS[:2])]
        return f"({bases}) " + "; ".join(methods)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""  # type: ignore[attr-defined]
    return f"({ast.unparse(node.args)}){returns}"  # type: ignore[attr-defined]


def _source(node: ast.stmt) -> str:
    return ast.dump(_without_docstrings(node), include_attributes=False)


def _members(node: ast.stmt) -> dict[str, ast.stmt]:
    """A class's own defs (methods, nested classes)."""
    if not isinstance(node, ast.ClassDef):
        return {}
    return {n.name: n for n in node.body if isinstance(n, _DEFS)}


def _parameters(node: ast.stmt) -> dict[str, str]:
    """{parameter name: its text (annotation, default)} of a function; of a class: of its own ``__init__``."""
    if isinstance(node, ast.ClassDef):
        init = _members(node).get("__init__")
        return {} if init is None else _parameters(init)
    args = node.args  # type: ignore[attr-defined]
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    listed = [(a, d, "") for a, d in zip(positional, defaults)]
    if args.vararg:
        listed.append((args.vararg, None, "*"))
    listed += [(a, d, "") for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        listed.append((args.kwarg, None, "**"))
    result = {}
    for arg, default, star in listed:
        text = star + arg.arg + (f": {ast.unparse(arg.annotation)}" if arg.annotation is not None else "")
        result[star + arg.arg] = text + (f" = {ast.unparse(default)}" if default is not None else "")
    return result


def _signature_detail(old: ast.stmt, new: ast.stmt) -> str:
    """What differs between two signatures: parameters added (+), removed (-) or changed (~: annotation, default,
    order), the bases or the return annotation."""
    before, after = _parameters(old), _parameters(new)
    parts = [f"+{after[n]}" for n in after if n not in before]
    parts += [f"-{n}" for n in before if n not in after]
    parts += [f"~{after[n]}" for n in after if n in before and before[n] != after[n]]
    if not parts and [n for n in before if n in after] != [n for n in after if n in before]:
        parts.append("parameters reordered")
    if not parts:
        parts.append(f"{_signature(old)}  ->  {_signature(new)}")
    return "; ".join(parts)


def _class_detail(old: list[ast.stmt], new: list[ast.stmt]) -> str:
    """For a changed class: its methods whose signature or code differ, were added or were removed (else: the
    class body outside its methods)."""
    before, after = _members(old[0]), _members(new[0])
    parts = []
    classes: list = [old[0], new[0]]  # ClassDefs (the caller checked)
    bases = [", ".join(ast.unparse(b) for b in [*n.bases, *n.keywords]) for n in classes]
    if bases[0] != bases[1]:
        parts.append(f"bases: ({bases[0]}) -> ({bases[1]})")
    both = sorted(before.keys() & after.keys())
    signature = [n for n in both if _signature(before[n]) != _signature(after[n])]
    if signature:
        parts.append("signature: " + ", ".join(f"{n} ({_signature_detail(before[n], after[n])})" for n in signature))
    changed = [n for n in both if n not in signature and _source(before[n]) != _source(after[n])]
    if changed:
        parts.append("changed: " + ", ".join(changed))
    if after.keys() - before.keys():
        parts.append("added: " + ", ".join(sorted(after.keys() - before.keys())))
    if before.keys() - after.keys():
        parts.append("removed: " + ", ".join(sorted(before.keys() - after.keys())))
    return "; ".join(parts) or "class body outside its methods (attributes, decorators)"


class _Release:
    """One release's transformers folder, its files parsed on first use."""

    def __init__(self, root: Path):
        self.package = Path(root) / "transformers"
        if not self.package.is_dir():
            raise FileNotFoundError(f"{root} holds no transformers package folder (expected {self.package})")
        self._trees: dict[str, ast.Module | None] = {}

    def find(self, location: str) -> list[ast.stmt]:
        file, _, qualname = location.partition(":")
        if file not in self._trees:
            path = self.package / file
            self._trees[file] = ast.parse(path.read_text(encoding="utf-8"), str(path)) if path.is_file() else None
        tree = self._trees[file]
        return [] if tree is None else _lookup(tree, qualname)


def compare(old_root: Path, new_root: Path, internals: dict[str, str] | None = None) -> list[Row]:
    """For each internal (default :data:`INTERNALS`): how its definition in `new_root`'s transformers differs from
    `old_root`'s (each folder holds a ``transformers`` package, e.g. an extracted wheel)."""
    old, new = _Release(old_root), _Release(new_root)
    rows = []
    for name, location in (INTERNALS if internals is None else internals).items():
        before, after = old.find(location), new.find(location)
        if not before and not after:
            rows.append(Row(name, "missing", f"in neither release ({location})"))
        elif not after:
            rows.append(Row(name, "missing", f"removed from {location.partition(':')[0]}"))
        elif not before:
            rows.append(Row(name, "new", f"not in the baseline's {location.partition(':')[0]}"))
        elif [_signature(n) for n in before] != [_signature(n) for n in after]:
            is_class = isinstance(after[0], ast.ClassDef)
            detail = _class_detail(before, after) if is_class else _signature_detail(before[0], after[0])
            rows.append(Row(name, "changed (signature)", detail))
        elif [_source(n) for n in before] != [_source(n) for n in after]:
            detail = _class_detail(before, after) if isinstance(after[0], ast.ClassDef) else ""
            rows.append(Row(name, "changed (source)", detail))
        else:
            rows.append(Row(name, "unchanged"))
    return rows


# ------------------------------------------------------------------------------------------------ the releases
def _release(text: str) -> tuple[int, ...]:
    """'5.24.0' -> (5, 24, 0); as compat._release."""
    match = re.match(r"\d+(?:\.\d+)*", text.strip())
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def tested_range(compat: Path = COMPAT) -> tuple[str, str]:
    """compat.TESTED_TRANSFORMERS, read from the file's text (importing it would import nothing heavy, but the
    package's __init__ would run)."""
    for node in ast.parse(compat.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TESTED_TRANSFORMERS" for t in node.targets):
            low, high = ast.literal_eval(node.value)
            return str(low), str(high)
    raise LookupError(f"{compat} defines no TESTED_TRANSFORMERS = (lowest tested, first untested)")


def _newest_in(folder: Path, below: str) -> str | None:
    """The highest version folder DIR/<version>/transformers below `below` (None if there is none)."""
    versions = [
        p.name
        for p in folder.glob("*")
        if (p / "transformers").is_dir() and _release(p.name) and _release(p.name) < _release(below)
    ]
    return max(versions, key=_release) if versions else None


def _pip_download(spec: str, into: Path) -> Path:
    """The transformers wheel that pip picks for `spec`, downloaded into `into`."""
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "-d", str(into)]
    result = subprocess.run([*command, spec], capture_output=True, text=True)
    wheels = sorted(into.glob("transformers-*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(
            f"`pip download {spec}` failed (exit {result.returncode}): {result.stderr.strip()[-800:]}\n"
            "PyPI must be reachable from this Python's pip; or extract the wheels yourself and pass --from-dir DIR "
            "(DIR/<version>/transformers)"
        )
    return wheels[0]


def _extracted(wheel: Path, staging: Path) -> Path:
    """`wheel`'s transformers/ extracted into `staging` (its folder then holds `transformers`)."""
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m.startswith("transformers/")]
        archive.extractall(staging, members)
    return staging


def wheel_folder(spec: str, cache: Path = CACHE) -> tuple[str, Path]:
    """(version, folder holding its transformers package) for a pip requirement on transformers (`==5.25.0`,
    `<5.26`): downloaded once, then read from `cache`/<version>/. Offline, a `==` release already in the cache is
    used, as is, for a range, the highest cached release in it (with a note on stderr)."""
    cache.mkdir(parents=True, exist_ok=True)
    exact = re.fullmatch(r"==\s*(\S+)", spec)
    if exact and (cache / exact.group(1) / "transformers").is_dir():
        return exact.group(1), cache / exact.group(1)
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=".download-"))
    try:
        try:
            wheel = _pip_download(f"transformers{spec}", staging)
        except RuntimeError:
            below = re.fullmatch(r"<\s*(\S+)", spec)
            cached = _newest_in(cache, below.group(1)) if below else None
            if cached is None:
                raise
            print(f"note: PyPI not reachable; using the cached transformers {cached}", file=sys.stderr)
            return cached, cache / cached
        version = wheel.name.split("-")[1]
        target = cache / version
        if not (target / "transformers").is_dir():
            # extracted beside, then renamed: an interrupted run leaves no half folder that looks complete
            _extracted(wheel, staging)
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
        return version, target
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def installed_folder() -> tuple[str, Path]:
    """(version, folder) of the transformers installed beside this Python, found without importing it."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"no transformers is installed for {sys.executable}: install it, or name a version")
    return importlib.metadata.version("transformers"), Path(next(iter(spec.submodule_search_locations))).parent


def resolve(version: str, from_dir: Path | None) -> tuple[str, Path]:
    if version == "installed":
        return installed_folder()
    if from_dir is not None:
        folder = from_dir / version
        if not (folder / "transformers").is_dir():
            raise FileNotFoundError(
                f"{folder} holds no transformers folder: extract transformers {version}'s wheel there"
            )
        return version, folder
    return wheel_folder(f"=={version}")


def default_baseline(from_dir: Path | None) -> tuple[str, Path]:
    """The newest tested release: the highest below compat.TESTED_TRANSFORMERS[1]."""
    low, high = tested_range()
    if from_dir is not None:
        version = _newest_in(from_dir, high)
        if version is None or _release(version) < _release(low):
            raise FileNotFoundError(f"{from_dir} holds no <version>/transformers in the tested range >={low},<{high}")
        return version, from_dir / version
    return wheel_folder(f"<{high}")


# ------------------------------------------------------------------------------------------------ the report
def table(rows: list[Row], version: str, baseline: str) -> str:
    width = max(len(row.name) for row in rows)
    status = max(len(s) for s in STATUSES)
    lines = [f"transformers {version} against {baseline} (the internals hf_statecompose reads)", ""]
    lines.append(f"{'internal'.ljust(width)}  {'status'.ljust(status)}  detail")
    lines.append(f"{'-' * width}  {'-' * status}  ------")
    for row in rows:
        detail = row.detail if len(row.detail) <= 160 else row.detail[:157] + "..."
        lines.append(f"{row.name.ljust(width)}  {row.status.ljust(status)}  {detail}".rstrip())
    counts = {s: sum(row.status == s for row in rows) for s in STATUSES}
    lines += ["", ", ".join(f"{n} {s}" for s, n in counts.items() if n)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="the transformers release to check (e.g. 5.26.0), or `installed`")
    parser.add_argument(
        "--baseline", help="the release to compare against (default: the newest tested, below TESTED_TRANSFORMERS[1])"
    )
    parser.add_argument("--from-dir", type=Path, help="read DIR/<version>/transformers instead of downloading wheels")
    parser.add_argument(
        "--json", action="store_true", help="print JSON: {version, baseline, rows: [{name, status, detail}]}"
    )
    parser.add_argument("--fail-on-change", action="store_true", help="exit 1 when any internal is not unchanged")
    args = parser.parse_args(argv)
    try:
        version, new = resolve(args.version, args.from_dir)
        baseline, old = resolve(args.baseline, args.from_dir) if args.baseline else default_baseline(args.from_dir)
    except (RuntimeError, FileNotFoundError, LookupError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    rows = compare(old, new)
    if args.json:
        report = {"version": version, "baseline": baseline, "rows": [dataclasses.asdict(row) for row in rows]}
        print(json.dumps(report, indent=2))
    else:
        print(table(rows, version, baseline))
    return 1 if args.fail_on_change and any(row.status != "unchanged" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
