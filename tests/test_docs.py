"""docs/ stays true: its tables match the code, its links resolve, its example runs."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

from pagedkv.cli import main
from pagedkv.spec.block_state import TRANSITIONS
from pagedkv.vocab.semantics import SEMANTICS_BY_NAME, Semantics

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_the_state_table_is_the_specs_transition_table() -> None:
    rows = re.findall(
        r"^\| `(\w+)` +\| (\w+) +\| (`[\w`, ]+`) *\|$", (DOCS / "states.md").read_text(), re.M
    )
    documented = {
        (state, event): frozenset(re.findall(r"`(\w+)`", targets)) for state, event, targets in rows
    }
    actual = {
        (state.name, event.name): frozenset(target.name for target in targets)
        for (state, event), targets in TRANSITIONS.items()
    }
    assert documented == actual


def test_semantics_md_names_every_switch_and_every_named_semantics() -> None:
    text = (DOCS / "semantics.md").read_text()
    for switch in dataclasses.fields(Semantics):
        assert f"`{switch.name}`" in text, switch.name
    for name in SEMANTICS_BY_NAME:
        assert f"`{name}`" in text, name


PAGES = sorted(DOCS.rglob("*.md"))
INCLUDE = re.compile(r'^--8<-- "([^":]+)(?::\w+)?"$', re.M)


def _page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", [*PAGES, ROOT / "README.md"], ids=_page_id)
def test_relative_links_resolve(page: Path) -> None:
    """Every relative link names a file; a docs page's stays inside docs/, the site's sources."""
    for target in re.findall(r"\]\((?!https?:)([^)#]+)", page.read_text()):
        path = (page.parent / target).resolve()
        assert path.exists(), f"{page.name} links to missing {target}"
        if page.is_relative_to(DOCS):
            assert path.is_relative_to(DOCS), f"{page.name} links outside docs/: {target}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_included_files_exist(page: Path) -> None:
    for included in INCLUDE.findall(page.read_text()):
        assert (ROOT / included).is_file(), f"{page.name} includes missing {included}"


def test_the_readme_links_every_docs_page() -> None:
    """The README is the map on GitHub: it names every page, or the file a page includes; the
    site's home (index.md, the README's own overview) and the API pages (under docs/api/, reached
    from docs/api/index.md) aside."""
    readme = (ROOT / "README.md").read_text()
    assert "docs/api/index.md" in readme
    for page in DOCS.glob("*.md"):
        if page.name == "index.md":
            continue
        text = page.read_text()
        body = re.sub(r"<!--.*?-->", "", text, flags=re.S).strip()
        if INCLUDE.fullmatch(body):
            (included,) = INCLUDE.findall(body)
            assert included in readme, f"{page.name} includes {included}"
        else:
            assert f"docs/{page.name}" in readme, page.name


@pytest.mark.parametrize("page", [*PAGES, ROOT / "README.md"], ids=_page_id)
def test_code_blocks_are_plain_python_or_mermaid(page: Path) -> None:
    """A ```python block runs in tests/test_readme.py; any other language would silently not."""
    for language in re.findall(r"^ *```(\S*)$", page.read_text(), re.M):
        assert language in ("", "python", "mermaid"), f"{page.name}: ```{language}"


def test_the_checking_guide_example_is_a_factory_verify_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    guide = (DOCS / "checking-your-manager.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", guide, re.S)
    (tmp_path / "mypool.py").write_text(example)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mypool", raising=False)
    assert main(["verify", "--quiet", "--impl", "mypool:make_pool", "--steps", "300"]) == 0
    assert "spec vs mypool:make_pool" in capsys.readouterr().out
