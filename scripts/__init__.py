"""Tools around the program: set-up, quickstart, launch scripts and the benchmarks."""
