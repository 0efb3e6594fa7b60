"""Lay the repository out as an importable `pagedkv` package: a tree of symbolic links that
follows `[tool.setuptools] package-dir` in pyproject.toml, without installing anything.

    python3 gpu/link_tree.py REPO TREE   # then PYTHONPATH=TREE python3 -c "import pagedkv"

It runs before `pagedkv` can be imported (gpu/first_device.sh calls it by path), so it imports
only the standard library (tomllib, or tomli on Python 3.10). Each mapped package becomes a
directory of the tree: one link to its whole folder when nothing below it is mapped elsewhere,
else a real directory holding a link per entry of its folder and, in place of an entry, each
child package mapped to another folder. A folder added to the mapping (a new top-level folder,
say `vocab` as `pagedkv.vocab`) or a subpackage added inside a mapped folder appears with no
change here. The links point into the repository, so nothing is ever written there.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path


def package_dirs(pyproject: Path) -> dict[str, Path]:
    """`[tool.setuptools] package-dir` of `pyproject`, folders resolved against its directory.

    Raises:
        SystemExit: no TOML reader (Python 3.10 without tomli), or no mapping to follow.
    """
    if sys.version_info >= (3, 11):
        import tomllib as toml
    else:  # pragma: no cover - the dev and CI Python is 3.11
        try:
            import tomli as toml  # type: ignore[import-not-found, unused-ignore]
        except ModuleNotFoundError:
            raise SystemExit(
                "link_tree: reading pyproject.toml needs Python 3.11 or tomli"
            ) from None
    with pyproject.open("rb") as handle:
        config = toml.load(handle)
    mapping = config.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    if not isinstance(mapping, dict) or not mapping:
        raise SystemExit(f"link_tree: {pyproject} maps no package ([tool.setuptools] package-dir)")
    return {str(name): pyproject.parent / str(folder) for name, folder in mapping.items()}


def _natural(name: str, mapping: Mapping[str, Path]) -> Path | None:
    """Where `name` lies when only its nearest mapped ancestor is mapped (None: no ancestor)."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        ancestor = ".".join(parts[:cut])
        if ancestor in mapping:
            return mapping[ancestor].joinpath(*parts[cut:])
    return None


def _place(name: str, target: Path, mapping: Mapping[str, Path]) -> None:
    """Make `target` the package `name`: a link to its folder, or a directory of links."""
    folder = mapping[name]
    moved = [
        other
        for other in mapping
        if other.startswith(name + ".") and _natural(other, mapping) != mapping[other]
    ]
    if not moved:
        target.symlink_to(folder.resolve(), target_is_directory=True)
        return
    target.mkdir()
    children = {other.split(".")[len(name.split("."))] for other in moved}
    for entry in sorted(folder.iterdir()) if folder.is_dir() else []:
        if entry.name not in children:
            (target / entry.name).symlink_to(entry.resolve())
    for child in sorted(children):
        child_name = f"{name}.{child}"
        if child_name not in mapping:  # only deeper packages are mapped: follow the folder
            mapping = {**mapping, child_name: folder / child}
        _place(child_name, target / child, mapping)


def build(pyproject: Path, tree: Path) -> list[str]:
    """Create the link tree of every top-level package of `pyproject`'s mapping under `tree`
    (an empty or missing directory). Returns the mapped package names, sorted.

    Raises:
        SystemExit: as `package_dirs`; FileExistsError: `tree` holds one of the packages.
    """
    mapping = package_dirs(pyproject)
    tree.mkdir(parents=True, exist_ok=True)
    for name in sorted(mapping):
        if "." not in name:
            _place(name, tree / name, mapping)
    return sorted(mapping)


def main(argv: Sequence[str] | None = None) -> int:
    """`link_tree.py REPO TREE`: build TREE from REPO/pyproject.toml; print the packages."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        sys.stderr.write("usage: python3 gpu/link_tree.py REPO TREE\n")
        return 64
    names = build(Path(args[0]) / "pyproject.toml", Path(args[1]))
    sys.stdout.write(f"link tree {args[1]}: {' '.join(names)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
