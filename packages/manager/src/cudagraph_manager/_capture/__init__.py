"""Capture: recordings, the warm-up rule, foreground and background capture, decode loops, the estimate."""
