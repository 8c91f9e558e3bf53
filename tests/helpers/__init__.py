"""Code the tests share: corpora and shard writers (docs), test planners and planner runs (planners), the gloo
rank harness (distributed), the pipeline model (pipeline_model) and what its gloo runs share (pipeline_run), the
SIGKILL harness (kill_harness) and the one-step transformers Trainer setup (hf_trainer).

tests/conftest.py puts tests/ on sys.path, so tests import `helpers.<module>`; processes the tests start (spawned
ranks, DataLoader workers, subprocesses) inherit that path or are given it."""
