"""cplib inside the training loops people already run (docs/clients.md)."""
