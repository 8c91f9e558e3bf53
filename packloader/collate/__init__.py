"""Collated batches: the tensors a trainer receives for one micro-batch, and CP shard metadata."""
