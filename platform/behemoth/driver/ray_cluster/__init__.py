"""What the driver does with Ray (public APIs; the private ones behind ray_internals/).

- `session`: starts or joins Ray; the workers' environment; Ray Train's settings; warm-up
- `output_filter`: the filter on Ray's forwarded worker output: installed, lines held between batches
- `output_scan`: what of Ray's output is noise (proven whole) and what is a real traceback (pure)
- `failure_policy`: Ray Train's failure policy, plus: a data or config error is not retried
- `placement_cleaner`: Ray Train's placement-group cleaner, naming its own cluster
- `stale_requests`: a killed driver's resource request withdrawn when its run is rerun
- `warmup`: the data pipeline's processes started while Ray Train starts its own
"""
