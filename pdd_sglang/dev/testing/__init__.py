"""Helpers for tests and demos: the tiny local model and a cluster of real SGLang servers."""
