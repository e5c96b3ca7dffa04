"""Benchmarks behind ``kvstrata bench <job>``: each measures kvstrata beside its baseline and ceiling."""
