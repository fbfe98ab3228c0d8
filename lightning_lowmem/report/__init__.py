"""``MemoryReport``: the measured step beside its prediction, rendered."""
