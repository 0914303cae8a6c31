"""A small, readable LLM trainer: model, data, tokenizer, loop, checkpoints, evaluation."""
