"""The benchmarks, by kind, and the figures they feed; every script runs as a module from the repository root.

- `performance/`: time and memory of the package against TRL (`python -m benchmarks.performance.loss_step`, ...).
- `experiments/`: training outcomes over seeds and settings (`python -m benchmarks.experiments.demo_seeds`, ...).
- `tools/`: the figures renderer and the test-suite timer (`python -m benchmarks.tools.render_figures`, ...).
- `shared/`: what the scripts and the tests import (provenance, memory, statistics, tiny models, launches).
- `figures/`: the renderers of the pages' figures; `results/`: the files they read.
- `python -m benchmarks.refresh --stale`: re-run the measurements whose measured code changed.
"""
