"""The steps: the step path, eager steps, and run_loop's run."""
