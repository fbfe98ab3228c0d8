"""The GPU checks: three offline stages of at most 9 minutes each (README "GPU checks"; ``make gpu-check STAGE=N``)."""
