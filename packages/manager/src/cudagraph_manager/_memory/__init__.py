"""Memory: the device's byte counts around a recording, and the weights the graphs read (sleep and wake)."""
