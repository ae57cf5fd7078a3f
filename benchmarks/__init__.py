"""The benchmarks and the figures they feed (`python -m benchmarks.refresh`); each script also runs on its own."""
