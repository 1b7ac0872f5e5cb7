"""The docs build as a site and the README stays a front door.

`mkdocs build --strict` fails on a page under docs/ that nav leaves out, on a link to a file
that is not in the site and on an anchor no heading makes (mkdocs.yml's `validation`), so this
build is the check that the docs hold together. The README is not part of the site: its links
are checked here, and its length is held to one page."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200

# [text](target): the target up to a space or the closing parenthesis (a title may follow).
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s[^)]*)?\)")


def test_the_docs_build_strictly(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        print(output)
    assert "No module named mkdocs" not in output, (
        "mkdocs is missing: install the docs extra (pip install -c constraints.txt -e .[docs])"
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{output}"
    assert (tmp_path / "index.html").is_file()
    assert (tmp_path / "benchmarks" / "index.html").is_file()


def test_the_readme_is_one_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): "
        "move the detail to a page under docs/ and link it"
    )


def _relative_links(text: str) -> list[str]:
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor in the README itself
        out.append(target.split("#", 1)[0])
    return out


def test_the_readme_links_point_at_files_that_exist() -> None:
    links = _relative_links((ROOT / "README.md").read_text())
    assert links, "the README links no file: the docs map is missing"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert missing == [], f"README.md links files that do not exist: {missing}"


def test_the_link_finder_reads_what_a_readme_holds() -> None:
    text = (
        "[a](docs/a.md) [b](docs/b.md#part) [c](https://example.org/x) [d](#top) "
        '[e](mailto:x@y.z) [f](docs/f.md "title")'
    )
    assert _relative_links(text) == ["docs/a.md", "docs/b.md", "docs/f.md"]
