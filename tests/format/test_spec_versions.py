"""The specification names one format version everywhere: ``spec/FORMAT.md``'s title, the
overview in ``spec/README.md`` and the newest version the reader accepts are the same number (a
spec bumped in one place and not the other misleads a second implementation)."""

from __future__ import annotations

import re

from kit import REPO

from ckptfmt.manifest.limits import FORMAT_VERSION, SUPPORTED_VERSIONS


def _version(pattern: str, text: str) -> int:
    m = re.search(pattern, text)
    assert m, f"no format version found by {pattern!r}"
    return int(m.group(1))


def test_the_spec_names_one_format_version() -> None:
    title = (REPO / "spec" / "FORMAT.md").read_text(encoding="utf-8").splitlines()[0]
    spec = _version(r"^# ckptfmt checkpoint format, version (\d+)$", title)
    overview = (REPO / "spec" / "README.md").read_text(encoding="utf-8")
    said = _version(r"normative specification of format\s+version (\d+)", overview)
    assert spec == said == max(SUPPORTED_VERSIONS), (spec, said, SUPPORTED_VERSIONS)
    assert FORMAT_VERSION in SUPPORTED_VERSIONS
