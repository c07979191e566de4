"""`sammie gate`: cases.py (the frozen images and prompts), reference.py (transformers'
Sam3Model with the same weights), run.py (the comparison, thresholds, report)."""
