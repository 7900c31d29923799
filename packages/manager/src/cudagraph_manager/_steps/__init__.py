"""Steps: the step plan, the replay, the eager steps, and run_loop's run."""
