"""How ``protect()`` attaches to each kind of model: transformers (AttentionInterface + projection hooks, GPT-Neo's
``_attn``), plain SDPA modules (TorchFunctionMode), ``nn.MultiheadAttention``, and trainer callbacks."""
