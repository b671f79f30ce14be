"""The documentation: the mkdocs site builds without a warning; README, ARCHITECTURE and docs link to what exists.

``mkdocs build --strict`` with the validation in ``mkdocs.yml`` fails on a broken link or anchor between pages, a page
left out of the nav, and a docstring or cross-reference mkdocstrings cannot render.
"""

import ast
import html
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
PAPER = re.compile(r"\b[Pp]aper (\d{3})\b")


def _docstring(path, name):
    """The docstring of the top-level function or class ``name`` of a source file, read without importing it."""
    (node,) = [n for n in ast.parse(path.read_text()).body if getattr(n, "name", None) == name]
    return ast.get_docstring(node, clean=False)


def _prose(path):
    """The lines of a Markdown file outside fenced code blocks."""
    fence = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            yield line


def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "WARNING" not in output, output
    # the API reference is rendered from the docstrings (not left as ``:::`` lines)
    page = (site / "api" / "private_gradient" / "index.html").read_text()
    assert "::: dpzero_jax" not in page
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", "", page)).split())        # the page's text, tags removed
    for source, name in (("config.py", "DPConfig"), ("engine.py", "private_value_and_grad")):
        first_line = _docstring(ROOT / "dpzero_jax" / source, name).splitlines()[0].replace("``", "")
        assert first_line in text, (name, first_line)
    assert (site / "benchmarks" / "overhead" / "index.html").exists()


def test_readme_and_architecture_links_resolve_inside_the_repository():
    for name in ("README.md", "ARCHITECTURE.md"):
        path = ROOT / name
        for target in LINK.findall("\n".join(_prose(path))):
            if target.startswith(("http://", "https://", "#")):
                continue
            file = (path.parent / target.split("#")[0]).resolve()
            assert file.is_relative_to(ROOT) and file.exists(), f"{name} links to {target}, which does not exist"
        # no path that leaves the repository (the design card and the papers are not part of it)
        assert not re.search(r"\.\./|/work/", path.read_text()), f"{name} points outside the repository"


def test_every_cited_paper_is_in_the_bibliography_and_linked_from_the_docs():
    bibliography = (ROOT / "docs" / "bibliography.md").read_text()
    entries = set(re.findall(r"^## paper (\d{3})$", bibliography, re.M))
    sources = [*ROOT.glob("dpzero_jax/**/*.py"), *ROOT.glob("experiments/*.py"), *ROOT.glob("tests/*.py"),
               ROOT / "README.md", ROOT / "ARCHITECTURE.md", *ROOT.glob("docs/**/*.md")]
    cited = {number for path in sources for number in PAPER.findall(path.read_text())}
    assert {"000", "002", "003"} <= cited and cited <= entries | {"001"}, (cited, entries)
    for path in ROOT.glob("docs/**/*.md"):   # in the pages' prose every mention is a link to its entry
        if path.name == "bibliography.md" or path.parent.name == "api":
            continue
        for line in _prose(path):
            for match in PAPER.finditer(line):
                if line[match.start() - 1:match.start()] == '"':   # the short name itself, in quotes, not a citation
                    continue
                assert line[match.end():].startswith("](") and "bibliography.md#paper-" in line, (path, line)
