"""staleopt."""
