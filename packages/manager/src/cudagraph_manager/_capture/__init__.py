"""Capture: the plan's keys, the warm-up rule, foreground and background capture, the estimate."""
