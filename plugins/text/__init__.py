"""Text classification: the Rotten Tomatoes snippets (``data``), the Transformer encoder with
any norm at Post or Pre placement (``model``) and its trainer (``trainer``);
docs/text_classification.md."""
