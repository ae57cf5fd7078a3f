"""Time and memory of the package's paths against TRL's, each script a `python -m benchmarks.performance.<name>`."""
