"""The wheels users install (docs/installing.md): the pure one is `py3-none-any`, carries no
extension module, the license and the project metadata, and runs from where pip puts it;
`pagedkv --version` says which version and build runs."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib import metadata
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest
from setuptools.config.pyprojecttoml import read_configuration

import pagedkv
from pagedkv.cli import main, version_line

ROOT = Path(__file__).resolve().parent.parent


def test_version_names_the_version_the_build_and_the_python(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    build = "compiled with mypyc" if pagedkv.COMPILED else "pure Python"
    expected = (
        f"pagedkv {metadata.version('pagedkv')} ({build}, Python {platform.python_version()})"
    )
    assert capsys.readouterr().out == expected + "\n"
    assert version_line() == expected


def test_the_extras_name_one_cupy_per_cuda_major_and_no_cuda_torch() -> None:
    extras = read_configuration(ROOT / "pyproject.toml")["project"]["optional-dependencies"]
    assert extras["gpu"] == extras["gpu-cuda13"]
    assert [extras[f"gpu-cuda{major}"][0] for major in (12, 13)] == [
        "cupy-cuda12x>=14",
        "cupy-cuda13x>=14",
    ]
    assert "tqdm>=4.60" not in extras["engine"]  # pagedkv.progress draws the bars


@pytest.mark.slow
def test_the_pure_wheel_is_py3_none_any_and_runs_where_pip_installs_it(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    config = read_configuration(ROOT / "pyproject.toml")
    for folder in {
        path.split("/")[0] for path in config["tool"]["setuptools"]["package-dir"].values()
    }:
        (source / folder).symlink_to(ROOT / folder, target_is_directory=True)
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        (source / name).symlink_to(ROOT / name)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q"]
    build = subprocess.run(
        [*pip_wheel, "-w", str(tmp_path / "dist"), str(source)],
        env={**os.environ, "PAGEDKV_BUILD": "pure"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    version = config["project"]["version"]
    assert wheel.name == f"pagedkv-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = f"pagedkv-{version}.dist-info"
        tags = archive.read(f"{info}/WHEEL").decode()
        meta = Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        license_text = archive.read(f"{info}/licenses/LICENSE").decode()
    assert "Root-Is-Purelib: true" in tags.splitlines()
    assert "Tag: py3-none-any" in tags.splitlines()
    assert not [name for name in names if name.endswith((*EXTENSION_SUFFIXES, ".so", ".c"))]
    assert "pagedkv/block_pool.py" in names and "pagedkv/gpu/paged_attention.cu" in names
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert meta["License-Expression"] == "Apache-2.0"
    classifiers = meta.get_all("Classifier") or []
    for minor in (10, 11, 12, 13):
        assert f"Programming Language :: Python :: 3.{minor}" in classifiers
    assert {"gpu-cuda12", "gpu-cuda13", "engine", "verify"} <= set(meta.get_all("Provides-Extra"))

    site = tmp_path / "site-packages"
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site)]
    done = subprocess.run([*install, str(wheel)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = "import pagedkv, pagedkv.cli; print(pagedkv.__file__); pagedkv.cli.main(['--version'])"
    ran = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    where, line = ran.stdout.splitlines()
    assert Path(where).is_relative_to(site)
    assert line.startswith(f"pagedkv {version} (pure Python, Python ")
