"""The Python side of the CUDA kernels: their torch bindings and the PyTorch references they must match.

The CUDA sources (sgemm.cu, flash_attn_fwd.cu) stay in the repository's top-level `kernels/`, which is not a
Python package and is not installed.

build.py compiles them (cubins + ptxas figures wherever nvcc exists; the torch extension on CUDA machines),
reference.py holds the references, cpu.py the checks that run on every machine, emulate.py runs the kernels' code
on the CPU (one thread per CUDA thread; the tests and `python -m frugaltune.kernels.emulate` run it), cuda.py
verifies and benchmarks them on a CUDA device, attention.py plugs the attention into transformers, report.py
builds what the `kernels` stage (stages/kernels.py) writes.
"""
