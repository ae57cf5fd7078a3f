"""The figures renderer and the test-suite timer, each a `python -m benchmarks.tools.<name>`."""
