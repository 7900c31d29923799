"""Graphs: the graph table, a recording, the warm-up rule, the estimate, and the capture sessions."""
