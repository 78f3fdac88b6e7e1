"""frugaltune: fine-tune small language models on the hardware people have, reproducibly.

The library behind the DVC stages (`stages/`) and the Prefect flow (`flows/`); it knows nothing of either.
"""

import logging


class _NoHubKernelNotice(logging.Filter):
    """Drops bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" warning.

    On CPUs with avx512_bf16, importing bitsandbytes tries to fetch a kernel from the Hugging Face hub and warns
    when it cannot, in every process that loads QLoRA. frugaltune never downloads at run time (offline by design),
    so the fallback it warns about is the intended path and the warning is noise; any other bitsandbytes message
    passes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in str(record.msg)


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_NoHubKernelNotice())

__version__ = "0.1.0"
