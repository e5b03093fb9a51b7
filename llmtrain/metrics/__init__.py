"""What a run reports while it trains: Prometheus metrics, the goodput ledger, the console."""
