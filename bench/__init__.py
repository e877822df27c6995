"""`make bench`: figures for BENCHMARKS.md, each ratio measured side by side in one run."""
