"""Fetch a few source files of a vllm release from PyPI, reading as little of its wheel as possible.

A wheel is a zip archive whose central directory sits at its end. `RangeReader` is a seekable
file over HTTP range requests, so `zipfile` reads the directory and the wanted members only:
a few hundred kilobytes of a 330 MB wheel, in a handful of requests. A server that ignores
ranges gets a full, streamed download instead (its sha256 checked against the index). Each
member is checked against its zip CRC-32 as it is read.

Where things come from: the index's JSON API (PEP 691) lists the versions and each wheel's URL,
size and sha256. `PAGEDKV_PYPI_INDEX` overrides the index (default https://pypi.org/simple).
Where they go: `PAGEDKV_CACHE` or `~/.cache/pagedkv` (one folder per release; written once,
completed by a marker file, reused by every later run).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_INDEX = "https://pypi.org/simple"
JSON_API = "application/vnd.pypi.simple.v1+json"
TIMEOUT_S = 60.0
MIN_RANGE_BYTES = 1 << 18  # each request reads at least this much: members lie close together
COMPLETE_MARKER = ".complete"
_RELEASE = re.compile(r"^\d+(\.\d+)*$")


class FetchError(Exception):
    """A vllm release could not be fetched (no network, no such version, a damaged file)."""


@dataclass(frozen=True)
class WheelFile:
    """One wheel of a release, as the package index lists it."""

    filename: str
    url: str
    size: int
    sha256: str | None


def cache_root() -> Path:
    """Where fetched files are kept: `$PAGEDKV_CACHE`, else `~/.cache/pagedkv`."""
    configured = os.environ.get("PAGEDKV_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "pagedkv"


def index_url() -> str:
    return os.environ.get("PAGEDKV_PYPI_INDEX", DEFAULT_INDEX).rstrip("/")


def release_key(version: str) -> tuple[int, ...]:
    """Sort key of a final release ("0.10.2" after "0.9.2")."""
    return tuple(int(part) for part in version.split("."))


def _get_json(url: str) -> dict[str, object]:
    request = urllib.request.Request(url, headers={"Accept": JSON_API})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            data = json.load(response)
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise FetchError(f"cannot read the package index at {url}: {error}") from error
    if not isinstance(data, dict):
        raise FetchError(f"the package index at {url} did not answer with a JSON object")
    return data


def project_listing(project: str = "vllm") -> dict[str, object]:
    """The index's JSON page of `project`: its versions and files."""
    return _get_json(f"{index_url()}/{project}/")


def newest_release(listing: Mapping[str, object]) -> str:
    """The highest final release (no pre-, post- or dev-release) in an index listing."""
    versions = listing.get("versions")
    if not isinstance(versions, list):  # API 1.0: only file names
        files = listing.get("files")
        names = [f.get("filename", "") for f in files] if isinstance(files, list) else []
        versions = [str(name).split("-")[1] for name in names if str(name).count("-") >= 2]
    releases = [str(v) for v in versions if _RELEASE.match(str(v))]
    if not releases:
        raise FetchError("the package index lists no final release of vllm")
    return max(releases, key=release_key)


def pick_wheel(listing: Mapping[str, object], version: str) -> WheelFile:
    """A wheel of `version` (any platform: only its Python sources are read), x86_64 first."""
    files = listing.get("files")
    candidates = []
    for entry in files if isinstance(files, list) else []:
        name = str(entry.get("filename", ""))
        if name.startswith(f"vllm-{version}-") and name.endswith(".whl"):
            if entry.get("yanked"):
                continue
            digest = (entry.get("hashes") or {}).get("sha256")
            size = int(entry.get("size") or 0)
            candidates.append(WheelFile(name, str(entry["url"]), size, digest))
    if not candidates:
        raise FetchError(f"the package index has no wheel of vllm=={version}")
    candidates.sort(key=lambda wheel: ("x86_64" not in wheel.filename, wheel.filename))
    return candidates[0]


class RangeReader(io.RawIOBase):
    """A read-only, seekable view of a remote file through HTTP range requests.

    Every fetched span is kept, and each request reads at least `MIN_RANGE_BYTES`, so the
    zip reader's many small reads cost few round trips.
    """

    def __init__(self, url: str, size: int) -> None:
        super().__init__()
        self.url = url
        self.size = size
        self.position = 0
        self.spans: list[tuple[int, bytes]] = []
        self.num_requests = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, base + offset)
        return self.position

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        end = min(self.position + len(buffer), self.size)
        if end <= self.position:
            return 0
        data = self._read(self.position, end)
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)

    def _read(self, start: int, end: int) -> bytes:
        for span_start, span in self.spans:
            if span_start <= start and end <= span_start + len(span):
                return span[start - span_start : end - span_start]
        fetch_end = min(self.size, max(end, start + MIN_RANGE_BYTES))
        headers = {"Range": f"bytes={start}-{fetch_end - 1}"}
        request = urllib.request.Request(self.url, headers=headers)
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            if response.status != 206:
                raise FetchError(f"{self.url} does not serve byte ranges (HTTP {response.status})")
            data: bytes = response.read()
        self.num_requests += 1
        if len(data) != fetch_end - start:
            raise FetchError(f"{self.url}: asked for {fetch_end - start} bytes, got {len(data)}")
        self.spans.append((start, data))
        return data[: end - start]


def _download_whole(wheel: WheelFile, folder: Path) -> Path:
    """The whole wheel, streamed to `folder`, its sha256 checked against the index's."""
    target = folder / wheel.filename
    digest = hashlib.sha256()
    with urllib.request.urlopen(wheel.url, timeout=TIMEOUT_S) as response, target.open("wb") as out:
        while chunk := response.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if wheel.sha256 is not None and digest.hexdigest() != wheel.sha256:
        raise FetchError(f"{wheel.filename}: sha256 {digest.hexdigest()} is not the index's")
    return target


def read_members(wheel: WheelFile, names: Iterable[str]) -> dict[str, bytes]:
    """The named members of `wheel`, by range requests, or from a full download if need be."""
    wanted = list(names)
    try:
        with zipfile.ZipFile(RangeReader(wheel.url, wheel.size)) as archive:
            return {name: archive.read(name) for name in wanted}
    except KeyError as error:
        raise FetchError(f"{wheel.filename} has no member {error}") from error
    except (FetchError, urllib.error.URLError, OSError, zipfile.BadZipFile):
        pass  # no range support, or a damaged span: fall back to the whole file
    with tempfile.TemporaryDirectory(prefix="pagedkv-wheel-") as folder:
        try:
            path = _download_whole(wheel, Path(folder))
            with zipfile.ZipFile(path) as archive:
                return {name: archive.read(name) for name in wanted}
        except KeyError as error:
            raise FetchError(f"{wheel.filename} has no member {error}") from error
        except (urllib.error.URLError, OSError, zipfile.BadZipFile) as error:
            raise FetchError(f"cannot download {wheel.url}: {error}") from error


def source_tree(
    version: str,
    members: Iterable[str],
    stand_ins: Mapping[str, str],
    listing: Mapping[str, object] | None = None,
) -> Path:
    """A folder holding vllm `version`'s `members` and our `stand_ins`, importable as `vllm`.

    Fetched once into the cache, in a folder named after the version and a digest of what it
    holds (new stand-ins get a new folder); later calls return it without any network.

    Raises:
        FetchError: the index or the wheel could not be read.
    """
    members = sorted(members)
    digest = hashlib.sha256(repr((members, sorted(stand_ins.items()))).encode()).hexdigest()
    root = cache_root() / f"vllm-{version}-{digest[:12]}"
    if (root / COMPLETE_MARKER).exists():
        return root
    wheel = pick_wheel(listing if listing is not None else project_listing(), version)
    files = read_members(wheel, members)
    files.update({name: text.encode() for name, text in stand_ins.items()})
    staging = Path(tempfile.mkdtemp(prefix=f"vllm-{version}-", dir=_ensure(root.parent)))
    for name, data in files.items():
        target = staging / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    (staging / COMPLETE_MARKER).write_text(f"{wheel.filename}\n")
    try:
        staging.rename(root)
    except OSError:  # another run finished first, or a half-written folder is in the way
        if not (root / COMPLETE_MARKER).exists():
            shutil.rmtree(root, ignore_errors=True)
            staging.rename(root)
    shutil.rmtree(staging, ignore_errors=True)
    return root


def _ensure(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder
