"""The Python examples of the README and of the documentation pages run, so they cannot rot."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
EXAMPLES = [
    (page.relative_to(ROOT).as_posix(), source)
    for page in PAGES
    for source in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
]

# Where the examples live. An example that moves, or whose fence stops reading ```python (and so
# stops running here), changes these counts: update them with it.
EXAMPLES_PER_PAGE = {
    "README.md": 1,
    "docs/checking-your-manager.md": 1,
    "docs/events.md": 2,
    "docs/hybrid-models.md": 4,
    "docs/run.md": 1,
    "docs/using.md": 2,
}


def test_the_examples_are_where_they_are_expected() -> None:
    assert Counter(page for page, _ in EXAMPLES) == EXAMPLES_PER_PAGE


@pytest.mark.parametrize(
    ("page", "source"),
    EXAMPLES,
    ids=[f"{page}-{i}" for i, (page, _) in enumerate(EXAMPLES)],
)
def test_example_runs(page: str, source: str) -> None:
    exec(compile(source, str(ROOT / page), "exec"), {"__name__": "readme_example"})
