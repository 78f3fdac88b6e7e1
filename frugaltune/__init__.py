"""frugaltune: fine-tune small language models on the hardware people have, reproducibly.

The library behind the DVC stages (`stages/`) and the Prefect flow (`flows/`); it knows nothing of either.
"""

__version__ = "0.1.0"
