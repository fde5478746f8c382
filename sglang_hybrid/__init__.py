"""sglang-hybrid: a semantic-aware recurrent-state checkpoint cache for SGLang."""

__version__ = "0.1.0"
