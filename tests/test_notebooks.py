"""The notebooks run top to bottom on the embedded model (small sizes via their parameters cell)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
#: one point of 02_kvcmas's tau sweep: each point runs the same code (fill the pools, compare_methods)
SMALL = {"MAX_NEW_TOKENS": "6", "N_REQUESTS": "3", "TRAJECTORY_TOKENS": "256", "TAUS": "[0.6]"}


def shrink(nb) -> None:
    """Override the values assigned in the cell tagged `parameters` with small ones."""
    for cell in nb.cells:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            lines = []
            for line in cell.source.splitlines():
                name = line.split("=")[0].strip()
                lines.append(f"{name} = {SMALL[name]}" if name in SMALL else line)
            cell.source = "\n".join(lines)
            return
    raise AssertionError("notebook has no cell tagged 'parameters'")


def test_outputs_are_stripped():
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        dirty = [
            i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)
        ]
        assert not dirty, f"{path.name}: strip outputs of cells {dirty}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    shrink(nb)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
