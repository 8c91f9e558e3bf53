"""The loader: torchdata nodes from shards to this rank's collated micro-batches, resumable exactly."""
