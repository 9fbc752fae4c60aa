"""`pipeflow train`: the command-line trainer. Its run configuration (`run_config`), token data
(`data`, `prepare`), the loop itself (`loop`), metrics, traces and plots."""
