"""lm-eval-harness integration: the ``statecompose`` model (:class:`~hf_statecompose.lmeval.model.StateComposeLM`)
and the bundled ``statecompose_*`` tasks (:data:`TASKS_DIR`).

Named ``lmeval`` (not ``lm_eval``) so that it never shadows the harness itself. Importing
``hf_statecompose`` registers the model name lazily (nothing heavy is imported until lm-eval asks for it).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
TASKS = ("statecompose_wikipedia", "statecompose_wikipedia_rolling", "statecompose_recall_mc")
MODEL_TARGET = "hf_statecompose.lmeval.model:StateComposeLM"


class ModelArgumentError(ValueError):
    """``--model_args`` the ``statecompose`` model cannot use (reported by :func:`run_cli` as one line, exit 2)."""


def register() -> bool:
    """Register ``statecompose`` in lm-eval's model registry (lazily, idempotent). False if lm-eval is absent."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        return False
    import lm_eval.models  # noqa: F401  the built-in names first: get_model() only loads them into an *empty* registry
    from lm_eval.api.registry import model_registry

    if "statecompose" not in model_registry:  # already there (placeholder or class): nothing to do
        model_registry.register("statecompose", target=MODEL_TARGET)
    return True


def git_hash() -> str | None:
    """lm-eval's ``get_git_commit_hash`` (the results' ``git_hash``) without the "fatal: not a git repository" that
    git prints on stderr when the working directory is outside a repository: ``git describe --always`` with its
    stderr discarded, else, as lm-eval does, the commit read from ``./.git`` (None outside a repository)."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, FileNotFoundError):  # not a repository / no git
        return get_commit_from_path(os.getcwd())


@contextlib.contextmanager
def quiet_git():
    """lm-eval's evaluator with :func:`git_hash` for its git metadata (restored on exit)."""
    import lm_eval.evaluator as evaluator

    saved = getattr(evaluator, "get_git_commit_hash", None)
    if saved is None:  # pragma: no cover - both supported lm-eval releases have it
        yield
        return
    evaluator.get_git_commit_hash = git_hash
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = saved


def run_cli(argv: list[str] | None = None) -> int:
    """Run lm-eval's own command line with ``statecompose`` registered; ``--include_path`` defaults to
    the bundled tasks (``hf-statecompose lm-eval run --model statecompose --tasks statecompose_wikipedia ...``).
    Quiet as the package's other entry points (:func:`~hf_statecompose.compat.quiet_transformers`), and without
    git's "fatal: not a git repository" when run outside a repository (:func:`quiet_git`)."""
    register()
    from lm_eval.__main__ import cli_evaluate

    from ..compat import quiet_transformers

    argv = list(sys.argv[1:] if argv is None else argv)
    wants_help = not argv or argv[0] in ("-h", "--help") or (len(argv) == 1 and argv[0] in ("run", "ls", "validate"))
    if not wants_help and not any(a == "--include_path" or a.startswith("--include_path=") for a in argv):
        argv += ["--include_path", str(TASKS_DIR)]
    saved = sys.argv
    sys.argv = ["lm-eval"] + argv
    try:
        with quiet_transformers(), quiet_git():
            cli_evaluate()
    except SystemExit as done:  # argparse / lm-eval exits
        code = done.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except ModelArgumentError as error:  # a user error, not a bug: no traceback (HF_STATECOMPOSE_DEBUG=1 shows it)
        if os.environ.get("HF_STATECOMPOSE_DEBUG"):
            raise
        print("hf-statecompose lm-eval: error: " + " ".join(str(error).split()), file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    return 0
