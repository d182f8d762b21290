"""What a run tells: console and file logs, metrics sinks and trackers, figures at the end of a run."""
