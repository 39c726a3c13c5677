"""The prepared GPU check (docs/gpu.md): ``benchmarks/gpu/run.sh``."""
