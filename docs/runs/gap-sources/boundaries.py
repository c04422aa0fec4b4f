"""Train the bench's reference 300 steps, then its held-out loss with the default forward codec's round trip
(tahquant's reference at qmax 12, 8, 4) at boundary 0, boundary 1 or both, in evaluation only."""
import torch

from reference import reference
from tahnode.kernels import tahquant_rice_ref as rice
from tahnode.train.model import StageModel

replica, dataset, heldout = reference()
for step in range(300):
    replica.train_step(step)


@torch.no_grad()
def heldout_loss(noisy: set, qmax: int) -> float:
    total = 0.0
    for start in range(0, len(heldout), 32):
        tokens, labels = dataset.batch(heldout[start:start + 32])
        x = tokens
        for k, model in enumerate(replica.models):
            x = model(x)
            if k in noisy:
                params = rice.RiceParams(128, qmax)
                x = rice.decode(rice.encode(x, params), tuple(x.shape), params, x.dtype)
        total += float(StageModel.loss(x, labels)) * len(tokens)
    return total / len(heldout)


clean = heldout_loss(set(), 12)
print(f"clean {clean:.5f}")
for qmax in (12, 8, 4):
    for noisy in ({0}, {1}, {0, 1}):
        loss = heldout_loss(noisy, qmax)
        print(f"qmax {qmax} boundaries {sorted(noisy)}: {loss:.5f} ({100 * (loss / clean - 1):+.3f}%)")
