"""``python -m hf_statecompose``: see :mod:`hf_statecompose.cli`."""

import sys

from .cli import main

sys.exit(main())
