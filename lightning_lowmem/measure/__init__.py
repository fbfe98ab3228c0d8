"""Measured memory: ``MemoryTracker`` (live storages by phase, category and role), CUDA peaks, ``StepMemoryRecorder``."""
