"""Durable checkpoints of a training run: staged in RAM, copied to disk and remote storage in the
background, resumed from the newest complete one.

manager (the API the training loop calls), state (a rank's training state as tensors + JSON),
worker (the background thread), copies (RAM -> disk), remote (fsspec uploads), layout (step and
part directories on disk), agree (the step every node of a run has), ramdir (owners of RAM
staging directories, and removing those of runs that are gone).
"""
