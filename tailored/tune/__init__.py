"""`tailored tune`: the specialising loop as a command (docs/tune.md).

contract.py  the deployment contract (contract.yaml, validated with pydantic)
space.py     the configuration space, which candidates can change numerics, static refusals
profile.py   the profile a tune run writes and `tailored serve --profile` applies
invariants.py the engine's named contracts (invariants, failure classes) and their tests
measure.py   one candidate: a server, the invariant probes, `tailored bench`, the gate
search.py    the budgeted optuna search, resumable from its SQLite storage
report.py    Pareto front, chosen point, gain, plot, kb record
cli.py       the command

optuna, PyYAML and matplotlib are the `tune` extra, imported where used: `tailored serve`
needs only PyYAML, and only with --profile.
"""
