"""strategies."""
