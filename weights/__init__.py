"""Hugging Face checkpoint loading and saving (name maps per model)."""
