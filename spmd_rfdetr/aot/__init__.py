"""Ahead-of-time TPU compile check: torch_xla's HLO compiled for a real TPU topology by libtpu on a CPU-only host."""
