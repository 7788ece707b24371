"""Prompt templates shipped as package data (`*.md` files beside this one); see kvpage_cli.tasks.prompts."""
