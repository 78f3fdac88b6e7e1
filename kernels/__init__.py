"""CUDA kernels (sgemm.cu, flash_attn_fwd.cu), their torch bindings, and the PyTorch references they must match.

build.py compiles them (cubins + ptxas figures wherever nvcc exists; the torch extension on CUDA machines),
reference.py holds the references, cpu.py the checks that run on every machine, emulate.py runs the kernels' code
on the CPU (one thread per CUDA thread), cuda.py verifies and benchmarks them on a CUDA device, attention.py plugs
the attention into transformers. The `kernels` stage (stages/kernels.py) drives them.
"""
