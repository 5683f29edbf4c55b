"""The documentation site builds with warnings as errors and documents everything exported.

``sphinx-build -W --keep-going -b html docs <tmp>``, as a reader would build it
(``pip install -e ".[docs]"``): a docstring that is not valid reStructuredText,
a page outside every table of contents, a link to a page, file or heading that
does not exist, all fail the build. The generated API pages must then hold an
entry for every name that ``optax_hybrid`` exports, for every public module it
exports, and for every public function, class and listed constant of those
modules. The README is not part of the site: its relative links are checked
here against the files and headings they point to.
"""

import importlib
import inspect
import os
import re
import subprocess
import sys

import pytest

import optax_hybrid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs")
# Public modules that `import optax_hybrid` does not import (extra dependencies).
SEPARATELY_IMPORTED = ("optax_hybrid.gpu_compile", "optax_hybrid.gpu_compile.step_time")


def exported_modules() -> list:
  names = [v.__name__ for v in vars(optax_hybrid).values()
           if inspect.ismodule(v) and v.__name__.startswith("optax_hybrid.")
           and v.__name__.rsplit(".", 1)[1] in optax_hybrid.__all__]
  return [optax_hybrid] + [importlib.import_module(n) for n in sorted(names) + list(SEPARATELY_IMPORTED)]


def public_names(module) -> list[str]:
  """``__all__``, or else the functions and classes the module defines without a leading underscore."""
  if hasattr(module, "__all__"):
    return list(module.__all__)
  return [n for n, v in vars(module).items() if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))
          and v.__module__ == module.__name__]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  pytest.importorskip("sphinx")
  pytest.importorskip("myst_parser")
  out = tmp_path_factory.mktemp("site")
  build = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", DOCS, str(out)],
      capture_output=True, text=True, cwd=REPO, timeout=600)
  warnings = "\n".join(line for line in build.stderr.splitlines()
                       if ("WARNING" in line or "ERROR" in line) and "absl::" not in line)
  assert build.returncode == 0, f"sphinx-build failed:\n{warnings or build.stderr[-5000:]}"
  return out


def test_site_builds_with_warnings_as_errors(site):
  assert os.path.exists(os.path.join(site, "index.html"))
  # Every Markdown page under docs/ is a page of the site (an orphan would
  # already be a warning; this also catches a page excluded by mistake).
  pages = {os.path.relpath(os.path.join(dp, f), DOCS)[:-3] for dp, _, fs in os.walk(DOCS) if "_build" not in dp
           for f in fs if f.endswith(".md")}
  assert pages and all(os.path.exists(os.path.join(site, p + ".html")) for p in pages), pages


def test_api_pages_document_everything_exported(site):
  html = ""
  for dirpath, _, files in os.walk(os.path.join(site, "api")):
    html += "".join(open(os.path.join(dirpath, f)).read() for f in files if f.endswith(".html"))
  ids = set(re.findall(r'id="([^"]+)"', html))
  missing = []
  for module in exported_modules():
    if f"module-{module.__name__}" not in ids:
      missing.append(module.__name__)
    for name in public_names(module):
      value = getattr(module, name)
      if not inspect.ismodule(value) and f"{module.__name__}.{name}" not in ids:
        missing.append(f"{module.__name__}.{name}")
  assert not missing, f"not in the API pages (a docstring, a #: comment or a docs/api page is missing): {missing}"


def slug(heading: str) -> str:
  """A heading's anchor as GitHub and MyST (``myst_heading_anchors``) make it."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def test_readme_links_resolve():
  readme = open(os.path.join(REPO, "README.md")).read()
  links = re.findall(r"\]\(([^)\s]+)\)", readme)
  local = [link for link in links if not re.match(r"[a-z]+:", link)]
  assert local, "the README links to the docs"
  for link in local:
    path, _, anchor = link.partition("#")
    target = os.path.join(REPO, path) if path else os.path.join(REPO, "README.md")
    assert os.path.exists(target), f"README links to {link}: no such file"
    if anchor:
      headings = re.findall(r"^#+ (.*)$", open(target).read(), flags=re.M)
      assert anchor in {slug(h) for h in headings}, f"README links to {link}: no such heading"


# The guide says how and why, a few screens a page; dated measurements live in
# docs/records/, which the guide links to. docs/architecture.md is the
# internals' page (for those who change the library), not the guide's.
GUIDE_LINES = 250
NOT_GUIDE = ("index.md", "architecture.md")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def guide_pages() -> list[str]:
  return sorted(f for f in os.listdir(DOCS) if f.endswith(".md") and f not in NOT_GUIDE)


def test_guide_pages_are_a_few_screens_and_their_figures_live_in_the_records():
  assert {"getting_started.md", "choosing.md", "optimizer.md", "tiers.md", "streaming.md", "checkpoints.md",
          "errors.md"} <= set(guide_pages())
  records = os.listdir(os.path.join(DOCS, "records"))
  assert {"benchmarks.md", "testing.md"} <= set(records)
  long, dated = [], []
  for page in guide_pages():
    text = open(os.path.join(DOCS, page)).read()
    if text.count("\n") > GUIDE_LINES:
      long.append(f"{page}: {text.count(chr(10))} lines")
    # A date may stand only in a link to a record's heading.
    unlinked = re.sub(r"\]\(records/[^)]*\)", "]()", text)
    dated += [f"{page}: {m.group(0)}" for m in DATE.finditer(unlinked)]
  assert not long, f"guide pages over {GUIDE_LINES} lines (move measurements to docs/records/): {long}"
  assert not dated, f"dated figures in the guide (they belong in docs/records/, linked): {dated}"
