"""Console programs: argv, exit codes and messages; the core below knows nothing of them."""
