"""Training: arguments, loop, checkpointing, logging, and the CPU-compat shim."""
