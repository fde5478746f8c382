"""Checkpoint planning: which depths of a request get a recurrent-state checkpoint, and what a
held one is worth (docs/architecture.md, "Planning quantities")."""
