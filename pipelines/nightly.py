"""The nightly chain: compact, grade, materialize, check, export, then a summary.

    python -m pipelines.nightly --root s3://bucket/poimen --out s3://bucket/exports/2025-01-06
    python -m pipelines.nightly --root ./poimen-data --stages materialize,check

Exit status: 0 when every stage that ran succeeded (skipped stages are fine), 1 when one
failed, 2 for bad arguments or a missing log. ``--json`` prints the summary for scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from rich.console import Console

from poimen_data.jobs import chain as st
from poimen_data.jobs.chain import summary_table


def _verifier(spec: str) -> object:
    from importlib import import_module

    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise ValueError(f"--verifier {spec!r} must be MODULE:NAME")
    try:
        obj: object = import_module(mod)
    except ImportError:
        raise  # "No module named ...", said as it is
    except Exception as exc:  # noqa: BLE001 - the module's own fault (a SyntaxError, a
        # RuntimeError at import): one line naming it, as poimen grade says it
        raise ValueError(f"--verifier {spec!r}: importing {mod} raised "
                         f"{type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.nightly", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=os.environ.get("POIMEN_ROOT", "./poimen-data"),
                   help="log root: a path or fsspec URL (default $POIMEN_ROOT, ./poimen-data)")
    p.add_argument("--stages", default=",".join(st.STAGES),
                   help=f"comma-separated subset of {','.join(st.STAGES)}")
    p.add_argument("--out", default=None, help="export directory (default <root>/exports)")
    p.add_argument("--verifier", action="append", default=[],
                   help="MODULE:NAME of a verifier (repeatable; default: the examples)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = p.parse_args(argv)
    err = Console(stderr=True, soft_wrap=True, highlight=False)
    names = [s.strip() for s in a.stages.split(",") if s.strip()]
    bad = [n for n in names if n not in st.STAGES]
    if bad:
        err.print(f"error: unknown stage {bad[0]!r}; stages are {', '.join(st.STAGES)}")
        return 2
    import poimen_data as pdm

    try:
        verifiers = [_verifier(v) for v in a.verifier] or None
        log = pdm.open_log(a.root, create=False)
    except pdm.NotFound:
        err.print(f"error: no poimen log at {a.root}")
        return 2
    except (pdm.PoimenError, ImportError, AttributeError, ValueError) as exc:
        err.print(f"error: {exc}".splitlines()[0])
        return 2
    out = Console()
    results = st.run_chain(log, names, out_dir=a.out, verifiers=verifiers,
                           on_stage=None if a.json else
                           lambda r: out.print(f"{r.name}: {r.status} ({r.seconds:.2f} s)"))
    if a.json:
        print(json.dumps([r.__dict__ for r in results], indent=2))
    else:
        out.print(summary_table(results, f"nightly on {log.root} (head LSN {log.head})"))
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
