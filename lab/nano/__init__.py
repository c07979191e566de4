"""Helpers of lab/train_nano.py: corpus, tokenizer, training model, evaluation, export."""
