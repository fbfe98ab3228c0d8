"""The bottom layer: byte accounting, the CUDA seam, atomic files, shared model plumbing (imports only ``_internals``)."""
