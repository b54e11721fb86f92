"""The roles of a run and the handles that carry their calls."""
