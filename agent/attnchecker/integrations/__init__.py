"""How ``protect()`` attaches to each kind of model: transformers (AttentionInterface + projection hooks, GPT-Neo's
``_attn``), plain SDPA modules (TorchFunctionMode) and ``nn.MultiheadAttention``. The trainer callbacks sit above
the guard, in ``attnchecker.callbacks``: integrations never import the guard."""
