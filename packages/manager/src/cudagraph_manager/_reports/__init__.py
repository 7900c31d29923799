"""Reports: what a capture, an estimate and the steps did."""
