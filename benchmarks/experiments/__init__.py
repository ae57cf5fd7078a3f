"""Training outcomes over seeds and settings, each script a `python -m benchmarks.experiments.<name>`."""
