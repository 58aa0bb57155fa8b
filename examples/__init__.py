"""Runnable examples built on recshard (`python -m examples.dlrm.train --help`)."""
