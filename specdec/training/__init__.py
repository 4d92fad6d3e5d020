"""Training drafters on the target's own view of text (`specdec train-draft`)."""
