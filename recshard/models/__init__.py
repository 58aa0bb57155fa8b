"""Reference recommendation models under TorchRec's names (`recshard.models.dlrm`)."""
