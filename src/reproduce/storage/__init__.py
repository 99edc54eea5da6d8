"""What a run puts on disk, and how it stays whole: atomic writes of files and folders (`files.py`), the check of a
torch file's stored checksums (`files.check_torch_file`), the lock that keeps one run per folder (`lock.py`), and the
previous run that `--force` sets aside until the new one has taken its first step (`aside.py`). No torch: the CLI's
launcher takes the lock, and `check` reads outputs, without it."""
