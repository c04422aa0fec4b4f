"""Train the bench's reference 300 steps, then its held-out loss with the default forward codec's round trip
(tahquant's reference at qmax 12, 8, 4) at boundary 0, boundary 1 or both, in evaluation only."""
from reference import reference
from tahnode.kernels import tahquant_rice_ref as rice

replica, heldout = reference()
for step in range(300):
    replica.train_step(step)
trained = list(replica.models)


def rounded(model, params):
    """`model`, its output sent through the codec's round trip."""
    def forward(x):
        y = model(x)
        return rice.decode(rice.encode(y, params), tuple(y.shape), params, y.dtype)
    return forward


def heldout_loss(noisy: set, qmax: int) -> float:
    """PipelineReplica.evaluate with boundaries `noisy` rounded at qmax."""
    params = rice.RiceParams(128, qmax)
    replica.models = [rounded(m, params) if k in noisy else m for k, m in enumerate(trained)]
    try:
        return replica.evaluate(heldout, 32)
    finally:
        replica.models = trained


clean = heldout_loss(set(), 12)
print(f"clean {clean:.5f}")
for qmax in (12, 8, 4):
    for noisy in ({0}, {1}, {0, 1}):
        loss = heldout_loss(noisy, qmax)
        print(f"qmax {qmax} boundaries {sorted(noisy)}: {loss:.5f} ({100 * (loss / clean - 1):+.3f}%)")
