"""Which signals help the forecast policy: token ids, router probabilities, later layers' guesses.

    python benchmarks/policy_signals.py ../shared/models/tiny-code-moe validation-olmoe ...

The `forecast` policy (moestream.core.policies.ForecastPolicy) predicts, for every expert, whether its
layer's next call will use it, from the expert ids of past calls and the token ids of each step. The
engine knows more at run time, and this measures what each extra signal would add if it were one more
feature of the same online logistic regression (so a trace would have to record it), and what the token
ids add:

    no-token-ids  forecast without the step's token ids (the token table never consulted)
    router-rank   the rank of the expert in its router's full probability at the current token (dense
                  evidence: the experts just below the top-k)
    next-layer    the next layer's router applied to this layer's input, as the prefetcher guesses; for
                  layer l+1 it is known one call ahead, while layer l runs
    later-layers  every later layer's router applied to this layer's input: while layer l runs, a guess
                  at the experts of layers l+2, l+3, ... of the same step (l+1's are about to be pinned),
                  refreshed at each layer; it prints how much of each distance's top-k the guess finds
    later-top-k   the same guesses, but only whether an expert is in a guess's top-k (as the token row is
                  whether the token took it), so the guess leaves the other experts' order alone
    step-stale    not a signal: every call's update deferred to the next step's start (one vectorized
                  pass per step would cost a layer count less), so each forecast is up to a step old

Each checkpoint (with heldout.txt beside it) is run once by transformers over the first --tokens tokens of
its held-out text, with hooks on its routers: a causal model routes each token the same whether it comes
alone or in a sequence, so one forward pass gives the routing that decoding the text would see. The routing
is replayed one decode call per token and layer through the runtime's cache and scheduler (simulate.replay),
and each variant's hits are printed as a share of Belady's MIN, per budget and on average.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from moestream.core.policies import ForecastPolicy, make_policy
from moestream.core.prefetch import find_router
from moestream.tools.simulate import BELADY, replay
from moestream.tools.trace import Trace


def routing(checkpoint: Path, tokens: int) -> dict[str, np.ndarray]:
    """ids [T], experts [T, L, k], probs [T, L, E] (softmax of the router logits), next_layer [T, L, E]
    (layer l's router on layer l-1's router input; zeros for layer 0), later [T, L, L, E] (layer j's router
    on layer l's router input, for j > l; zeros elsewhere)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(checkpoint)((checkpoint / "heldout.txt").read_text())["input_ids"][:tokens]
    routers = [r for r in (find_router(m) for m in model.modules() if hasattr(m, "experts")) if r is not None]
    seen: dict[int, tuple] = {}
    for i, router in enumerate(routers):
        # Routers return (logits, ..., top-k indices) in the families here; their input is the normed hidden.
        router.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, (args[0], out[0], out[-1])))
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
        experts = np.stack([seen[i][2].reshape(len(ids), -1).numpy() for i in range(len(routers))], 1)
        probs = np.stack([torch.softmax(seen[i][1].float(), -1).reshape(len(ids), -1).numpy() for i in range(len(routers))], 1)
        guess = np.zeros_like(probs)
        for i in range(1, len(routers)):
            logits = routers[i](seen[i - 1][0].reshape(len(ids), -1))[0]
            guess[:, i] = torch.softmax(logits.float(), -1).numpy()
        layers, k = len(routers), experts.shape[2]
        later = np.zeros((len(ids), layers, layers, probs.shape[2]), np.float32)
        for i in range(layers):
            for j in range(i + 1, layers):
                later[:, i, j] = torch.softmax(routers[j](seen[i][0].reshape(len(ids), -1))[0].float(), -1).numpy()
    for d in range(1, layers):  # how good the guesses are: the share of layer l+d's top-k in the guess's top-k
        found = [
            np.mean([len(set(g) & set(e)) for g, e in zip(np.argsort(-later[:, i, i + d], axis=1)[:, :k], experts[:, i + d])]) / k
            for i in range(layers - d)
        ]
        print(f"  {checkpoint.name}: layer l's input through layer l+{d}'s router finds {np.mean(found):.1%} of its top-{k}")
    return {"ids": np.array(ids), "experts": experts.astype(np.int64), "probs": probs, "next_layer": guess, "later": later}


def _ranks(scores: np.ndarray) -> np.ndarray:
    rank = np.empty(len(scores))
    rank[np.argsort(-scores)] = np.arange(len(scores))
    return np.log1p(rank)


class WithSignal(ForecastPolicy):
    """ForecastPolicy with one more feature row (before the bias), filled by `signal`."""

    def __init__(self, layer_experts, data: dict[str, np.ndarray], signal: str):
        super().__init__(layer_experts)
        self.data, self.signal, self.token = data, signal, -1
        rows = self._features.shape[1] + 1
        self._features = np.ones((self.layers, rows, self.experts), np.float32)
        self._scratch = np.empty((rows, self.experts), np.float32)
        self._weights, self._grad_sq = np.zeros(rows, np.float32), np.full(rows, 1e-3, np.float32)
        self.extra = rows - 2  # the row after the counts, the transition share and the token; the bias last
        # The feature's value where the guess says nothing (no guess for this layer yet): the mean rank.
        self.unknown = float(np.mean(np.log1p(np.arange(self.experts))))
        self._features[:, self.extra] = self.unknown

    def on_step(self, token_ids) -> None:
        self.token += 1
        if self.signal != "no-token-ids":
            super().on_step(token_ids)

    def _refresh(self, layer: int) -> None:
        self._logit[layer] = self._weights @ self._features[layer]
        self._masked[layer] = self._logit[layer] + self._uncached[layer]
        self._update_min(layer)

    def on_call(self, layer: int, experts) -> None:
        super().on_call(layer, experts)
        t, row = self.token, self._features[layer, self.extra]
        if self.signal == "router-rank":
            row[:] = _ranks(self.data["probs"][t, layer])
        elif self.signal in ("next-layer", "later-layers"):
            row[:] = self.unknown  # filled again before this layer's next call
        elif self.signal == "later-top-k":
            row[:] = np.log(0.1)  # no guess: as if outside the guessed top-k
        self._refresh(layer)
        if self.signal == "later-layers":
            for j in range(layer + 2, self.layers):
                self._features[j, self.extra] = _ranks(self.data["later"][t, layer, j])
                self._refresh(j)
        if self.signal == "later-top-k":
            k = self.data["experts"].shape[2]
            for j in range(layer + 2, self.layers):
                chosen = np.zeros(self.experts, np.float32)
                chosen[np.argsort(-self.data["later"][t, layer, j])[:k]] = 1.0
                self._features[j, self.extra] = np.log(chosen + 0.1)
                self._refresh(j)
        if self.signal == "next-layer" and layer + 1 < self.layers:
            self._features[layer + 1, self.extra] = _ranks(self.data["next_layer"][t, layer + 1])
            self._refresh(layer + 1)


class StepStale(ForecastPolicy):
    """ForecastPolicy whose per-call updates wait for the next step to start."""

    def __init__(self, layer_experts):
        super().__init__(layer_experts)
        self.waiting: list = []

    def on_call(self, layer: int, experts) -> None:
        self.waiting.append((layer, tuple(experts)))

    def on_step(self, token_ids) -> None:
        for layer, experts in self.waiting:
            super().on_call(layer, experts)
        self.waiting = []
        super().on_step(token_ids)


def make(variant: str, table, data):
    if variant in ("lfu", "forecast"):
        return make_policy(variant, table)
    return StepStale(table) if variant == "step-stale" else WithSignal(table, data, variant)


VARIANTS = ("lfu", "forecast", "no-token-ids", "router-rank", "next-layer", "later-layers", "later-top-k", "step-stale")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", type=Path)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--budgets", default="5,10,20,30", help="percent of all experts")
    args = parser.parse_args()
    budgets = [float(b) / 100 for b in args.budgets.split(",")]
    summary = {}
    for checkpoint in args.checkpoints:
        data = routing(checkpoint, args.tokens)
        tokens, layers, k = data["experts"].shape
        experts = data["probs"].shape[2]
        trace = Trace.of_decode(data["experts"].astype(np.int32), experts, token_ids=data["ids"])
        table = [experts] * layers
        print(f"\n{checkpoint.name}: {tokens} tokens, {layers} MoE layers x {experts} experts, top-{k}")
        print(f"{'budget':>7} {'belady':>7} " + " ".join(f"{v:>12}" for v in VARIANTS))
        shares = {v: [] for v in VARIANTS}
        for share in budgets:
            slots = max(k, round(share * layers * experts))
            best = replay(trace, slots, BELADY).hits
            for v in VARIANTS:
                shares[v].append(replay(trace, slots, make(v, table, data)).hits / best)
            print(f"{share:>7.0%} {best / (tokens * layers * k):>7.1%} " + " ".join(f"{shares[v][-1]:>11.3f}x" for v in VARIANTS))
        summary[checkpoint.name] = {v: float(np.mean(s)) for v, s in shares.items()}
        print("   mean         " + " ".join(f"{summary[checkpoint.name][v]:>11.3f}x" for v in VARIANTS))
    print(f"\nmean share of Belady's hits over {args.budgets}%")
    print(f"{'model':<24}" + " ".join(f"{v:>12}" for v in VARIANTS))
    for name, means in summary.items():
        print(f"{name:<24}" + " ".join(f"{means[v]:>11.3f}x" for v in VARIANTS))


if __name__ == "__main__":
    main()
