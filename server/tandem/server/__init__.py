"""Tandem's serving side: the engine, its HTTP API, P/D disaggregation and the proxy."""

from .openmp import default_spin

default_spin()  # before anything below imports torch, which loads libgomp and reads it once
