"""MkDocs hooks (mkdocs.yml `hooks:`): the docstrings use Sphinx roles (:func:`enable`), which mkdocstrings renders
literally; drop the role names and keep the code span."""

import re

_ROLE = re.compile(r":(?:func|meth|class|mod|data|attr|exc|obj):(?=<code>)")


def on_page_content(html: str, **kwargs) -> str:
    return _ROLE.sub("", html)
