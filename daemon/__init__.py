"""mtpserve: a serving daemon for language models with multi-token-prediction layers."""

__version__ = "0.1.0"
