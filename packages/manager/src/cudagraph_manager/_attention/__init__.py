"""The attention seam: the metadata builder's shapes and padding, and the support check."""
