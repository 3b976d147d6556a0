"""The adversarial trial (issue 21, split per attack family in issue 29): ``python benchmarks/adversarial.py --help``.

The families live in the package ``benchmarks/adversarial/`` (see its ``__init__.py`` for the outcomes); this
script loads that package under its own name (``hsc_adversarial``: ``adversarial`` is also the name of the tests'
package ``tests/adversarial/``) and exposes its names, so ``python benchmarks/adversarial.py ...`` and the tests'
``bench`` fixture work as before the split.
"""

from __future__ import annotations

import importlib.util
import os
import sys

_PACKAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "adversarial")


def _load():
    name = "hsc_adversarial"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(_PACKAGE, "__init__.py"), submodule_search_locations=[_PACKAGE]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_package = _load()
globals().update({k: v for k, v in vars(_package).items() if not k.startswith("__")})
main = _package.main

if __name__ == "__main__":
    sys.exit(main())
