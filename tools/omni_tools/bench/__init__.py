"""omni-bench: benchmarks of the served presets against what users would run instead.

Runs on the client side (the benchmark's own process), starting the servers and
baselines it compares as child processes. Each scenario writes its results as JSON
under docs/benchmarks/ and names the ratios it measures against their targets;
`omni-bench report` turns them into the summary and plots of docs/benchmarks.md.
"""
