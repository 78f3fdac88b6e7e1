"""Recipes: what a pipeline stage does, as library functions (train, evaluate), so that stages stay thin and share
them without importing each other. Library code; the stages in stages/ call them."""
