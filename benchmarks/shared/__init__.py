"""What the benchmark scripts and the tests import: provenance, memory, statistics, tiny models and launches."""
