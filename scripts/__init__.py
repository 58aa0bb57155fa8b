"""Tools to run recshard beyond one process group on 127.0.0.1 (see cluster.py)."""
