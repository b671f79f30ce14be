"""Pallas kernels for per-example norms (one folder per op: reference, per-backend implementations, api)."""
