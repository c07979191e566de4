"""SAM 3's image detector in plain PyTorch, named as the checkpoint names it (sam3.py is the
top; vit.py, neck.py, text.py, geometry.py, detr.py, mask.py its parts; attention.py the shared
blocks)."""
