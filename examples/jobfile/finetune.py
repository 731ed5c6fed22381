"""A stand-in fine-tuning loop for examples/jobfile/job.yaml: STEPS steps, then where it ran."""

import os

steps = int(os.environ.get("STEPS", "1"))
for step in range(1, steps + 1):
    print(f"step {step}/{steps}: loss {1.0 / step:.3f}")
where = os.environ.get("IRIS_CLUSTER", "?")
print(f"fine-tuned on {where} (devices {os.environ.get('CUDA_VISIBLE_DEVICES') or 'none'})")
