"""`python -m tests.outside_models`: fetch and cache the Flax sdist files the trials read (see sources.py)."""

from .sources import flax_source

print(flax_source(download=True))
