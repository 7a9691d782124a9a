"""The README and docs/: the quick start where a newcomer meets it, the commands it names, the public
API listed in docs/architecture.md, and every relative link pointing at a file that exists.

    python -m pytest -q tests/test_docs.py
"""

import re
from pathlib import Path

import megatron_multilevel

ROOT = Path(megatron_multilevel.__file__).parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
QUICK_START_LINES = 40

# A Markdown link's target: `](target)`, up to the closing parenthesis or a title after a space.
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(path: Path) -> list[str]:
    """The targets of ``path``'s Markdown links that are files of the repository (no URL, no bare
    anchor), without their ``#anchor``."""
    targets = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def quick_start_line(text: str) -> int:
    """The 1-based line of the later of the quick start's two commands, ``make run`` and ``make test``."""
    lines = text.splitlines()
    found = [next(i for i, line in enumerate(lines, 1) if line.startswith(cmd))
             for cmd in ("make run", "make test")]
    return max(found)


def test_readme_holds_the_two_commands():
    readme = README.read_text()
    assert "make run" in readme and "make test" in readme
    assert "launch/pretrain_vcycle.sh" in readme and "python -m pytest -q tests" in readme
    makefile = (ROOT / "Makefile").read_text()
    assert "launch/pretrain_vcycle.sh" in makefile and '-m pytest -q tests' in makefile
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


def test_quick_start_is_within_the_first_40_lines():
    line = quick_start_line(README.read_text())
    assert line <= QUICK_START_LINES, f"the quick start's commands end on line {line} of README.md"


def test_public_api_is_listed_in_architecture_doc():
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    for name in megatron_multilevel.__all__:
        assert f"`{name}`" in architecture, name
        assert hasattr(megatron_multilevel, name)


def test_relative_links_point_to_files_that_exist():
    broken = [f"{path.relative_to(ROOT)}: {target}"
              for path in [README, *DOCS] for target in relative_links(path)
              if not (path.parent / target).exists()]
    assert DOCS and not broken, broken


def test_readme_stays_a_front_door():
    """At most 120 lines: the figures live in docs/results.md, the README keeps its answer."""
    lines = len(README.read_text().splitlines())
    assert lines <= 120, f"README.md has {lines} lines; move detail into docs/"
