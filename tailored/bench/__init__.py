"""`tailored bench`: load generator, result files with manifests, roofline model.

loadgen.py     asyncio + httpx streaming client for any OpenAI-compatible server
results.py     result JSON (manifest, workload, metrics), `--compare` ratio table
roofline.py    bytes / FLOPs per decode step from a ModelConfig; time floor; achieved fraction
sidebyside.py  `bench/results/latest.json` from the JSONs of a side-by-side run
cli.py         `tailored bench` (add_parser / run)
"""
