"""Adversarial trial (issue 21): crafted state files, in-memory misuse, API misuse, store damage and kill -9
trials on both store backends, and CLI user errors, generated from a fixed seed; each case runs in its own
forked process with a timeout and is classified by an oracle.

    python benchmarks/adversarial.py [--seed 0] [--scale full|ci] [--json PATH] [--case ID] [--family NAME,...]

One module per attack family in ``benchmarks/adversarial/`` (``common.py``: models, oracle, forking runner;
``runner.py``: the driver, the table and the JSON); ``--family`` runs some of them (``--family registry,positions``)
and then writes ``adversarial-<families>.json``, never the full report.

Outcomes (one per case):

* ``clear``: refused with ValueError / TypeError / KeyError / IndexError / FileNotFoundError / PermissionError /
  IsADirectoryError / NotADirectoryError / TimeoutError / NotImplementedError (or a subclass), a one-line message of at most 400 characters, raised by a ``raise``
  statement in an hf_statecompose frame (the innermost frame of the traceback is in the package and its line is
  a ``raise``: a deliberate refusal, not a torch / safetensors / lancedb / Python error passing through); a
  TypeError of Python's own argument binding at the call site counts too. CLI: exit status 2 and one stderr
  line ``hf-statecompose: error: ...`` (no traceback).
* ``handled``: no error, and the case's oracle verified the result (a loaded state bitwise equal to the
  original, logits / generated tokens equal to the reference, a repeated write left one copy, ...).
* ``unclear``: any other exception (type, origin, several lines, longer than 400 characters), a child that died
  without an answer, a CLI traceback or another exit status.
* ``silent``: no error, but the oracle found the result wrong (a mutated file accepted as another state,
  logits changed by a corrupted state, duplicates, files outside the store changed, an invalid argument
  accepted where no valid reading exists).
* ``hang``: the case ran past its timeout (killed).
* ``lost`` (store cases, kill trials): a committed entry missing or unreadable (or different) after reopening,
  the store unopenable after a kill, or a killed multi-id ``delete`` half applied.

The models are tiny random ones built here (as tests/helpers.py does); nothing downloads. JSON (default
benchmarks/results/adversarial.json): the table per category and in total, and every non-clean case (silent,
unclear, hang, lost) with a one-line repro (``--case ID`` reruns one case in this process and prints its
traceback). ``--scale ci`` is the representative subset the test runs (tests/adversarial/).
"""

from .common import *  # noqa: F403 (the oracle and helpers, as the single-file script exposed them)
from .runner import *  # noqa: F403
from .runner import main as main
