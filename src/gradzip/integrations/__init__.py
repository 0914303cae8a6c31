"""Integrations with other training libraries (optional extras): ``hf`` for Hugging Face
``transformers``' ``Trainer``."""
