"""The chaos matrix of the reliability suite (docs/reliability.md)."""
