"""Helpers of scripts/train_nano.py: corpus, tokenizer, training model, evaluation, export."""
