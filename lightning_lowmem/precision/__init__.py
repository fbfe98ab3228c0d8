"""precision."""
