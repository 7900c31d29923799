"""Static inputs, their buffers and the outputs' cut: the values every layer above reads."""
