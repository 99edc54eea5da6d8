"""What a run puts on disk, and how it stays whole: atomic writes of files and folders (`files.py`), the check of a
torch file's stored checksums (`files.check_torch_file`), the lock that keeps one run per folder (`lock.py`), and the
previous run that `--force` sets aside until the new one has a checkpoint of its own (`aside.py`), SIGINT/SIGTERM
in every phase of a run (`signals.py`) and the fault tests' exact points (`faults.py`). No torch: the CLI's launcher
takes the lock, and `check` reads outputs, without it."""
