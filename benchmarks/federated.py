"""Federated learning of the demo CNN on the bundled digits (issue 36): accuracy per round against centralized
training, and what a round costs beside local training.

    python -m benchmarks.federated                      # 10 clients, Dirichlet(0.5) non-IID, FedAvg, 20 rounds
    python -m benchmarks.federated --strategy fedprox --proximal-mu 0.01
    python -m benchmarks.federated --tiny               # 3 clients, 2 rounds: a smoke run

Prints the test accuracy after every round, the centralized run's accuracy after as many epochs, and the
round overhead: the server's wall time per round minus the slowest client's local training, as a share of
that training. Flower's simulation engine (Ray) runs the clients (``--cpus-per-client`` each).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import onnx


def dirichlet_split(labels: np.ndarray, clients: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Sample indices per client: each class spread over the clients by Dirichlet(alpha) proportions."""
    rng = np.random.default_rng(seed)
    parts: list[list[int]] = [[] for _ in range(clients)]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        cuts = (np.cumsum(rng.dirichlet([alpha] * clients)) * len(idx)).astype(int)[:-1]
        for k, chunk in enumerate(np.split(idx, cuts)):
            parts[k] += chunk.tolist()
    return [np.array(sorted(p), dtype=np.int64) for p in parts]


def centralized(model: onnx.ModelProto, train: dict, test: dict, epochs: int, batch_size: int) -> list[float]:
    from onnx_autodiff import TrainingSession
    from onnx_autodiff.federated.evaluation import metrics_of

    sess = TrainingSession(model, progress=False)
    curve = []
    for epoch in range(epochs):
        sess.fit(train, batch_size, 1, seed=epoch, progress=False, log=lambda s: None)
        inference = sess.inference_model()
        import onnxruntime as ort
        out = ort.InferenceSession(inference.SerializeToString()).run(None, {"image": test["image"]})[0]
        curve.append(metrics_of({"logits": out}, {"logits": test["labels"]})["accuracy"])
    return curve


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.federated", description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=10, help="simulated clients (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=20, help="federated rounds (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=0.5,
                   help="Dirichlet concentration over labels (default: %(default)s)")
    p.add_argument("--strategy", default="fedavg", help="fedavg, fedprox, fedadam, ... (default: %(default)s)")
    p.add_argument("--proximal-mu", type=float, default=None, help="FedProx's mu (default: Flower's)")
    p.add_argument("--local-epochs", type=int, default=1, help="local epochs per round (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="local batch size (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="split and weights seed (default: %(default)s)")
    p.add_argument("--cpus-per-client", type=float, default=1.0,
                   help="Ray's num_cpus per client (default: %(default)s)")
    p.add_argument("--no-centralized", action="store_true", help="skip the centralized comparison")
    p.add_argument("--tiny", action="store_true", help="3 clients, 2 rounds: a smoke run")
    args = p.parse_args(argv)
    if args.tiny:
        args.clients, args.rounds = 3, 2

    from flwr.simulation import run_simulation

    from onnx_autodiff.cli.demo import cnn_model, load_digits, split
    from onnx_autodiff.federated import client_app, server_app
    from onnx_autodiff.training import make_training_model

    (x, y), (xt, yt) = split(*load_digits(), seed=args.seed)
    parts = dirichlet_split(y, args.clients, args.alpha, args.seed)
    model = make_training_model(cnn_model(args.seed), "cross_entropy", "adam", lr=args.lr)
    test = {"image": xt, "labels": yt}
    print(f"load {os.getloadavg()[0]:.2f}; {args.clients} clients, sizes {[len(q) for q in parts]}, "
          f"{args.strategy}, {args.rounds} rounds", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "train.onnx")
        onnx.save(model, path)
        for k, idx in enumerate(parts):
            np.savez(os.path.join(tmp, f"client-{k}.npz"), image=x[idx], labels=y[idx])
        stamps = []
        client = client_app(path, tmp, local_epochs=args.local_epochs, batch_size=args.batch_size, seed=args.seed)
        options = {"proximal_mu": args.proximal_mu} if args.proximal_mu is not None else {}
        server = server_app(path, args.strategy, rounds=args.rounds, min_clients=args.clients, evaluate=test,
                            log=lambda s: (stamps.append(time.perf_counter()), print(s, flush=True)), **options)
        run_simulation(server_app=server, client_app=client, num_supernodes=args.clients,
                       backend_config={"client_resources": {"num_cpus": args.cpus_per_client}}, verbose_logging=False)
    rounds = server.history[1:]
    print("\n| round | test accuracy | test loss |\n| --- | --- | --- |")
    for h in server.history:
        print(f"| {h['round']} | {h['accuracy']:.4f} | {h['loss']:.4f} |")
    seconds = np.diff(stamps)
    if len(seconds):
        print(f"\nround wall time: median {np.median(seconds):.2f} s over {len(seconds)} rounds")
    per_round = list(server.result.train_metrics_clientapp.values()) if server.result is not None else []
    if per_round:
        fit = np.array([m["fit_seconds"] for m in per_round])
        whole = np.array([m["client_seconds"] for m in per_round])
        print(f"a client's round: {np.median(whole):.3f} s, of which local training {np.median(fit):.3f} s: arrays "
              f"in and out (set, get, records) add {np.median((whole - fit) / fit):.1%} (median over rounds of "
              "the mean over clients weighted by samples)")
        peak = max(m["process_peak_mb"] for m in per_round)
        print(f"peak RSS of a process running clients (Ray actor): about {peak:.0f} MB (weighted mean over the "
              "round's clients, largest round)")
    import resource
    print(f"peak RSS of the server process (the simulation's own): "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    if not args.no_centralized:
        curve = centralized(model, {"image": x, "labels": y}, test, args.rounds, args.batch_size)
        print("centralized (same CNN, Adam, one epoch per round): " + ", ".join(f"{a:.4f}" for a in curve))
    return 0 if rounds else 1


if __name__ == "__main__":
    raise SystemExit(main())
