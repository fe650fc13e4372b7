"""The notebooks run top to bottom against a fresh demo root, and are committed with their
outputs (so they read well on GitHub without running them)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat
import pytest

NB_DIR = Path(__file__).resolve().parent.parent / "notebooks"
_spec = importlib.util.spec_from_file_location("nb_execute", NB_DIR / "execute.py")
assert _spec is not None and _spec.loader is not None
nb_execute = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nb_execute)


def _outputs(nb: nbformat.NotebookNode) -> list[dict]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def _text(nb: nbformat.NotebookNode) -> str:
    parts = []
    for o in _outputs(nb):
        if o["output_type"] == "stream":
            parts.append(o["text"])
        elif "data" in o:
            parts.append(o["data"].get("text/plain", ""))
    return "\n".join(parts)


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    from poimen_data.workload import demo

    root = str(tmp_path_factory.mktemp("nb") / "demo")
    demo.run(root, runs=120, seed=5, quiet=True)
    return root


@pytest.fixture
def env(demo_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("POIMEN_ROOT", demo_root)
    monkeypatch.setenv("POIMEN_EXPORT_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.slow
def test_01_explore_episodes(env: Path) -> None:
    nb = nb_execute.execute(NB_DIR / "01_explore_episodes.ipynb")
    images = [o for o in _outputs(nb) if "image/png" in o.get("data", {})]
    assert len(images) == 4  # retries, failure rate, usage and cost, dropped context
    text = _text(nb)
    assert "(a Decimal: Decimal)" in text and "live branch" in text
    assert "missing context" in text


@pytest.mark.slow
def test_02_grading(env: Path) -> None:
    nb = nb_execute.execute(NB_DIR / "02_grading.ipynb")
    text = _text(nb)
    assert "second call recorded 0 verdicts" in text
    assert "within_budget: 0 bodies read for 10 runs" in text
    assert "resolved: 10 bodies read for 10 runs" in text


@pytest.mark.slow
def test_03_export(env: Path) -> None:
    nb = nb_execute.execute(NB_DIR / "03_export.ipynb")  # asserts state == log bytes itself
    text = _text(nb)
    assert "records of 120 runs" in text and " pairs" in text
    assert (env / "live.jsonl").stat().st_size > 0 and (env / "pairs.jsonl").exists()


@pytest.mark.parametrize("name", nb_execute.NOTEBOOKS)
def test_committed_with_outputs_and_no_errors(name: str) -> None:
    nb = nbformat.read(NB_DIR / name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("execution_count") for c in code)  # every cell was run
    assert sum(bool(c.get("outputs")) for c in code) >= len(code) - 2
    assert not [o for o in _outputs(nb) if o["output_type"] == "error"]
