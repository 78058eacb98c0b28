"""The docs site builds strictly, and its magics reference comes from the parsers."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nbddp.notebook import magics

ROOT = Path(__file__).parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None,
    reason="needs mkdocs-material (pip install -e '.[docs]')",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    return out


def test_every_page_in_the_nav_is_built(site):
    nav = re.findall(r":\s*(\S+\.md)", (ROOT / "mkdocs.yml").read_text())
    assert len(nav) >= 12
    for page in nav:
        built = site / ("index.html" if page == "index.md" else f"{page[:-3]}/index.html")
        assert built.exists(), page


def test_the_magics_reference_lists_every_option_of_every_magic(site):
    html = (site / "magics" / "index.html").read_text()
    assert "%ddp copy" in magics.PARSERS
    for parser in magics.PARSERS.values():
        for action in parser.parser._actions:
            for option in action.option_strings:
                assert option in html, option
    assert "nbddp: magics help" not in html  # the marker was replaced
