"""Tandem's serving side: the engine, its HTTP API, P/D disaggregation and the proxy."""
