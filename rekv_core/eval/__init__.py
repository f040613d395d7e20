"""Prompts and measurements for judging what a handoff does to the model's output."""
