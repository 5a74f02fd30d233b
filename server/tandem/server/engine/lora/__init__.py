"""Multi-LoRA serving: PEFT adapters read and checked (``adapter``), which are resident and
who waits (``registry``, the engine's bookkeeping), and their products added per row in a
mixed batch (``layers``, the device side; ``segment`` is the seam a GPU kernel replaces).
See ``docs/lora.md``."""
