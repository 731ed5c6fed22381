"""The seed's `my_training_script.py`: a tiny training loop that needs its workspace.

It imports a sibling module (model.py) and reads a data file (data/corpus.txt); both travel with
the job in its workspace bundle, wherever it runs. Run it the seed's way, from this directory:

    uv run iris job run --device-type=h100 --gpu-count=8 my_training_script.py
"""

import os

from model import BigramModel

with open("data/corpus.txt") as f:
    corpus = f.read().split()

model = BigramModel(corpus)
for step in range(1, 4):
    print(f"step {step}: loss {model.train_step():.3f}")
where = os.environ.get("IRIS_CLUSTER", "?")
chips = os.environ.get("CUDA_VISIBLE_DEVICES") or "none"
print(f"trained on {where} ({len(corpus)} tokens; devices {chips})")
