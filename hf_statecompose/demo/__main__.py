"""``python -m hf_statecompose.demo``: see :mod:`hf_statecompose.demo.run`."""

import sys

from .run import main

sys.exit(main())
