"""`benchmarks/shared/provenance.py` under the plain name the one flat script imports it by
(`gradient_fidelity_experiment.py`, moved into `experiments/` by the lead after its runs; this file goes with it)."""

from shared.provenance import load_average, provenance  # noqa: F401
