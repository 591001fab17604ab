"""Triton kernels of ddtree_lab, installed as `ddtree_lab.kernels`; each module is a leaf with its torch
reference beside it. Importing changes no process state: compiled Triton needs a CUDA device, and on the
CPU the kernels run under Triton's interpreter only when TRITON_INTERPRET=1 is set before triton is first
imported (the tests do this)."""
