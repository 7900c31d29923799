"""Memory: the device's byte counts, the weights the graphs read (sleep and wake), compiled models."""
