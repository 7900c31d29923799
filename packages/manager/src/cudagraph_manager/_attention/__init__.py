"""The attention seam's helpers: the metadata in the forward context, padded offsets and rows."""
