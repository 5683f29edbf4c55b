"""Sphinx configuration of the optax_hybrid documentation site.

Build it with ``sphinx-build -W --keep-going -b html docs docs/_build/html``
(``pip install -e ".[docs]"``); ``tests/test_docs_site.py`` does the same in the
test run, warnings as errors. The pages are Markdown (MyST); the API pages are
generated from the docstrings (autodoc, Google-style sections by napoleon).
"""

import os
import sys

# The checkout's own package, whatever else is installed.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))
# Importing jax to read the docstrings must not probe for a GPU (the
# gpu-compile extra installs the CUDA plugin).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import optax_hybrid  # noqa: E402

project = "optax_hybrid"
author = "the optax_hybrid authors"
release = version = optax_hybrid.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]

# Links to a heading, `page.md#the-heading`, as GitHub writes them; a link
# to a page or heading that does not exist is a warning (an error with -W).
myst_heading_anchors = 3

# Signatures as in the guide pages; the types are in each docstring's Args.
autodoc_typehints = "none"
autodoc_member_order = "bysource"
# NamedTuple and dataclass fields are described once, by the class docstring's
# Attributes section (as :ivar:), not a second time from the fields themselves.
napoleon_use_ivar = True

html_theme = "alabaster"
html_title = f"optax_hybrid {release}"
html_theme_options = {
    "description": "AdamW for JAX and Optax with optimizer state in host memory",
    "fixed_sidebar": True,
}
