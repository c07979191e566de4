"""The local task set's loader (`custom_dataset: !function loader.load` in the YAML files):
the rows of a JSONL file beside this one as a `datasets` split, with nothing downloaded and no
dataset cache written (lm-evaluation-harness calls it with the task's `dataset_kwargs`)."""

import json
from pathlib import Path


def load(file: str, split: str = "test", **_metadata):
    import datasets

    path = Path(__file__).with_name(file)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})
