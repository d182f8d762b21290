"""What the loop is made of: the loss, optimiser and schedule, EMA, checkpoints, their averaging, and init_from."""
