"""reproduce: run a paper's large-batch training recipe on the hardware you have, exactly."""

__version__ = "0.1.0"
