"""Runs you can watch: what a run records about itself and where it goes.

records.py    RUN_FOLDER/metrics.jsonl (every report) and timeline.jsonl (invocations, worker groups, failures,
              resizes), local or under a URI (through pyarrow's filesystem)
callbacks.py  the Ray Train callbacks that write them, in Ray Train's controller (the driver's node), and
              feed TensorBoard and MLflow
tensorboard.py, mlflow_run.py, wandb_run.py   the three trackers (tracking section of the job config)
goodput.py    where a run's wall time went, over every restart and rerun (pure: records in, account out)
invocation.py the driver's side of one invocation of a run: its milestones, the trackers' runs, at its end
              the goodput account and the report
run_report.py `behemoth report`: report.html with embedded plots, and the PNGs
"""
