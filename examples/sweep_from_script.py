"""Sweep batch size and learning rate from your own Python script, then use the results.

    behemoth data synth-images --out data/demo_images      # once
    python examples/sweep_from_script.py                   # from the repository root

Rerunning it resumes the sweep named here (finished trials are not run again).
"""

from behemoth import sweep

result = sweep(
    "jobs/configs/demo_images.yaml",
    space={"train.lr": {"loguniform": [0.02, 0.5]}, "train.global_batch_size": {"choice": [32, 64]}},
    num_samples=4,
    set=["train.epochs=2", "scaling.num_workers=1", "scaling.cpus_per_worker=0.75"],
    scheduler={"kind": "asha", "grace_period": 1, "reduction_factor": 2},
    lr_scaling="linear",  # each sampled lr is for batch 64 (the job's); scaled to the trial's batch
    name="sweep_from_script",
)
# to_string: the whole table (pandas would elide columns of a wide table with "...")
print(result.table[["trial_id", "status", "train.lr", "train.global_batch_size", "lr", "val_accuracy"]].to_string(index=False))
print("best:", result.best_params, f"{result.metric} = {result.best_value:.4f}")
print("reproduce it with: behemoth train", result.best_yaml)
print("best checkpoint:", result.best_checkpoint)
