"""lm-eval-harness integration: the ``statecompose`` model (:class:`~hf_statecompose.lmeval.model.StateComposeLM`)
and the bundled ``statecompose_*`` tasks (:data:`TASKS_DIR`).

Named ``lmeval`` (not ``lm_eval``) so that it never shadows the harness itself. Importing
``hf_statecompose`` registers the model name lazily (nothing heavy is imported until lm-eval asks for it).
"""

from __future__ import annotations

import os
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


def run_cli(argv: list[str] | None = None) -> int:
    """Run lm-eval's own command line with ``statecompose`` registered; ``--include_path`` defaults to
    the bundled tasks (``hf-statecompose lm-eval run --model statecompose --tasks statecompose_wikipedia ...``)."""
    register()
    from lm_eval.__main__ import cli_evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    wants_help = not argv or argv[0] in ("-h", "--help") or (len(argv) == 1 and argv[0] in ("run", "ls", "validate"))
    if not wants_help and not any(a == "--include_path" or a.startswith("--include_path=") for a in argv):
        argv += ["--include_path", str(TASKS_DIR)]
    saved = sys.argv
    sys.argv = ["lm-eval"] + argv
    try:
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
