"""The decoder models: the Llama network (``llama.py``) and the families that set its flags.

Nothing is imported here, so ``models.config`` (``ModelConfig``, a leaf) costs no model code;
``families.py`` maps the architecture names HuggingFace configs carry to the classes.
"""
