"""DLRM on recshard: model, Criteo/synthetic data and the training CLI (`examples.dlrm.train`)."""
