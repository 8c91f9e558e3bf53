"""Attention over packed batches: varlen kernels, context parallelism, layout remapping, calibration."""
