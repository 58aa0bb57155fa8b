"""Datasets under TorchRec's names: `utils.Batch`, `random.RandomRecDataset`, `criteo` constants."""
