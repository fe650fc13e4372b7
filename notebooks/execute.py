"""Execute the notebooks top to bottom and save them with their outputs.

    python notebooks/execute.py                 # against a fresh demo root in a temp dir
    POIMEN_ROOT=./poimen-data python notebooks/execute.py 02_grading.ipynb

The tests run the same notebooks (without saving) against a fresh demo root.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
NOTEBOOKS = ("01_explore_episodes.ipynb", "02_grading.ipynb", "03_export.ipynb")


def execute(path: Path, *, timeout: int = 300) -> nbformat.NotebookNode:
    """Run one notebook in its own kernel (cwd: the notebooks folder); raises on an error."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(HERE)}}).execute()
    return nb


def main(names: list[str] | None = None) -> int:
    if "POIMEN_ROOT" not in os.environ:
        os.environ["POIMEN_ROOT"] = str(Path(tempfile.mkdtemp(prefix="poimen-nb-")) / "demo")
        from poimen_data.workload import demo

        demo.run(os.environ["POIMEN_ROOT"], quiet=True)
    for name in names or NOTEBOOKS:
        nb = execute(HERE / name)
        nbformat.write(nb, HERE / name)
        print(f"executed {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
