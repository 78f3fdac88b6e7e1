"""frugaltune: fine-tune small language models on the hardware people have, reproducibly.

The library behind the DVC stages (`stages/`) and the Prefect flow (`flows/`); it knows nothing of either.
"""

from frugaltune.generation import quiet_bitsandbytes_hub_notice

quiet_bitsandbytes_hub_notice()  # bitsandbytes' offline notice on avx512_bf16 CPUs: see generation.py

__version__ = "0.1.0"
