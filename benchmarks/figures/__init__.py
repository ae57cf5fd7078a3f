"""The renderers of the figures and tables on the user pages (`core` explains the mechanism); one module per area."""
