"""transformer-bench: timed steps, the profile window and its report."""
