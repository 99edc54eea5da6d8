"""Several processes: the world and its collectives under torchrun (processes.py), FSDP2 sharding
(fsdp.py), the one-machine launcher and its workers (launched.py)."""
