"""The synthetic workload (``synth``: a seeded, realistic stream of runs) and ``poimen
demo`` (``demo``: record it, run the chain, print the report).

Imports the layers below; only the face (CLI) and ``bench`` import it.
"""
