"""Trainer -> server weight synchronisation (versioned, changed blocks only)."""
