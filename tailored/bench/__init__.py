"""`tailored bench`: load generator, result files with manifests, roofline model.

loadgen.py     asyncio + httpx streaming client for any OpenAI-compatible server
results.py     result JSON (manifest, workload, metrics), `--compare` ratio table
roofline.py    bytes / FLOPs per decode step from a ModelConfig; time floor; achieved fraction
sidebyside.py  `bench/results/latest.json` from the JSONs of a side-by-side run
loadsweep.py   its `load` section: both engines over c = 1..128 and two long prompts
plot.py        `tailored bench --plot`: that section as a PNG (matplotlib, the `plot` extra)
workloads.py   --workload chat-mix | agent-mix, --request-rate, the goodput SLO options
agentmix.py    multi-turn conversations over shared long system prompts with tools
arrivals.py    seeded Poisson arrival times and the sender that keeps to them
goodput.py     requests within a TTFT / TPOT SLO per second
cli.py         `tailored bench` (add_parser / run)
"""
