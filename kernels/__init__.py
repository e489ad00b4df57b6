"""Compute kernels: a torch reference for every op, and (later) Triton kernels behind one dispatch."""
