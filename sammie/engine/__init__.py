"""The serving engine: images.py (decode, limits, resize), segmenter.py (a batch through the
model, the text-feature cache), postprocess.py (instances), rle.py (COCO RLE), batcher.py
(dynamic batching under a latency budget)."""
