"""The GPU checks: five offline stages of at most 9 minutes each (docs/gpu-checks.md; ``make gpu-check STAGE=N``)."""
