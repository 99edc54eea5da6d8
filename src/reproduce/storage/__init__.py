"""What a run puts on disk, and how it stays whole: atomic writes, the torch files' seal, the folder's lock, the
previous run `--force` sets aside, SIGINT/SIGTERM in every phase. No torch: the launcher and `check` use it."""
