"""Training: arguments and config sections, the loop and schedule, model and optimizer
builders, checkpoints (`checkpoint/`), logging and the rank's helper processes."""
