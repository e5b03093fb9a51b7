"""What a run reports: the event log and the console."""
