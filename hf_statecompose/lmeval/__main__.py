"""``python -m hf_statecompose.lmeval <lm-eval arguments>``: lm-eval's command line with the
``statecompose`` model registered and the bundled tasks on the include path (unless ``--include_path``
is given)::

    python -m hf_statecompose.lmeval run --model statecompose \\
        --model_args pretrained=demo,passages=bundled,k=5 --tasks statecompose_recall_mc
"""

import sys

from . import run_cli

sys.exit(run_cli())
