"""`sammie bench`: load.py (the load client), reference_server.py (transformers' Sam3Model and
Sam3Processor behind sammie's API), cli.py (`sammie bench`, `sammie reference`)."""
