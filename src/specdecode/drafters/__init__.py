"""Drafters: cheap proposers of the next tokens, verified by the target."""
