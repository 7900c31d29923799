"""Memory: the static buffers, the outputs cut from them, the device's bytes, the weights, the KV cache."""
