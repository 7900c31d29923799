"""The step path: the static buffers, the outputs' cut, eager steps and decode loops."""
