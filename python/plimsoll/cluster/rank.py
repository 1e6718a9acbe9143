"""One rank of a clustered load: the only module of ``plimsoll.cluster`` that imports mlx.

Started once per host, by :mod:`plimsoll.cluster.runner` (or by ``mlx.launch --backend
ring``, which sets the same ``MLX_RANK``/``MLX_HOSTFILE`` environment). Every rank:

1. joins the ring (``mx.distributed.init(backend="ring", strict=True)``);
2. reads its *own* memory figures (command-line overrides, else its own probe) and
   all-gathers them, so every rank computes the same pure plan
   (:func:`plimsoll.cluster.plan.plan_cluster`);
3. **preflight and reserve**: admits its own share; if admitted, reserves by lowering its
   MLX allocation limit to its admitted allocation limit; all-gathers the answers;
4. **commit all or roll back all** (:func:`plimsoll.cluster.plan.decide`, identical on every
   rank): on rollback it restores its limit, loads nothing and exits 3; on commit it loads
   only its own tensors (lazy load, foreign layers dropped before evaluation);
5. serves: rank 0 reads JSON requests on stdin and broadcasts each one to the ring; the
   pipeline passes activations rank → rank + 1 and the last rank's greedy token is
   all-summed back to every rank, so all ranks agree when to stop.

Events are JSON lines on stdout (``{"event": ...}``); the supervisor reads them. A lost
peer (mlx raises ``[ring] connection to a peer was lost``) ends the rank with exit 4 and a
reasoned ``error`` event, so one rank's death tears the ring down; a supervisor that dies
takes its ranks with it (parent watchdog).

Running out is checked by the rank itself before every decode step (mlx's memory limit is
soft on the CPU backend): active memory past the admitted allocation limit ends the rank
with exit 6, which ends the ring for every peer.

Exit codes: 0 shutdown, 2 cannot join the ring, 3 rolled back, 4 peer lost, 5 other error,
6 ran out of its admitted memory.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import threading
import time
from pathlib import Path

EXIT_OK, EXIT_INIT, EXIT_ROLLBACK, EXIT_PEER, EXIT_OTHER, EXIT_RAN_OUT = 0, 2, 3, 4, 5, 6
#: Fault injection for tests: allocate this many extra bytes at decode step FAULT_AT.
FAULT_BYTES, FAULT_AT = "PLIMSOLL_CLUSTER_FAULT_BYTES", "PLIMSOLL_CLUSTER_FAULT_AT"


class RanOut(RuntimeError):
    """This rank's memory went past its admitted allocation limit (mlx's CPU limit is soft)."""
OP_GENERATE, OP_SHUTDOWN = 1, 2


def emit(event: str, **fields) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def _parent_watchdog(period: float = 0.5) -> None:
    """Exit when the process that started this rank goes away (no orphan ranks)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(period)
            if os.getppid() != parent:
                os._exit(EXIT_OTHER)

    threading.Thread(target=watch, daemon=True, name="parent-watchdog").start()


def _own_probe(args, rank: int):
    """This rank's figures: ``--figures-by-rank`` [rank], else flags, else its own probe.

    The budget is the clustered ``maxLocalLlmGb`` of this host's policy (``--policy``),
    else the default policy for the probed machine, else the ceiling.
    """
    from plimsoll.cluster.plan import RankProbe

    figures = {"ceiling_bytes": args.ceiling_bytes, "total_ram_bytes": args.total_ram_bytes,
               "budget_bytes": args.budget_bytes}
    sources = []
    if args.figures_by_rank:
        mine = json.loads(args.figures_by_rank)[rank]
        figures.update({k: v for k, v in mine.items() if k in figures})
        sources.append(f"--figures-by-rank[{rank}]")
    elif figures["ceiling_bytes"] is not None:
        sources.append("command line")
    snap = None
    if figures["ceiling_bytes"] is None or figures["total_ram_bytes"] is None:
        from plimsoll.probes import read_snapshot

        snap = read_snapshot()
        sources.append(f"probe: {snap.ceiling_source}")
        figures["ceiling_bytes"] = figures["ceiling_bytes"] or snap.ceiling_bytes
        figures["total_ram_bytes"] = figures["total_ram_bytes"] or snap.total_ram_bytes
    if figures["budget_bytes"] is None:
        if args.policy:
            from plimsoll.policy import load_policy

            pol = load_policy(args.policy)
            figures["budget_bytes"] = pol.budget_bytes("clustered")
            sources.append(f"budget: policy {pol.host} clustered")
        elif snap is not None:
            from plimsoll.defaults import default_policy

            figures["budget_bytes"] = default_policy(snap).budget_bytes("clustered")
            sources.append("budget: default clustered policy")
        else:
            figures["budget_bytes"] = figures["ceiling_bytes"]
            sources.append("budget: the ceiling")
    return RankProbe(rank=rank, host=args.host, source=", ".join(sources), **figures)


class Ring:
    """The group and the few collectives the protocol needs (all bounded by the ring's peers)."""

    def __init__(self, mx, group):
        self.mx, self.group = mx, group
        self.rank, self.size = group.rank(), group.size()

    def all_gather_json(self, obj) -> list:
        mx = self.mx
        data = json.dumps(obj).encode()
        if self.size == 1:
            return [json.loads(data)]
        lengths = mx.distributed.all_gather(mx.array([len(data)], dtype=mx.int32),
                                            group=self.group)
        width = int(mx.max(lengths).item())
        buf = mx.zeros((width,), dtype=mx.uint8)
        if data:
            buf[: len(data)] = mx.array(list(data), dtype=mx.uint8)
        rows = mx.distributed.all_gather(buf, group=self.group).reshape(self.size, width)
        mx.eval(rows)
        out = []
        for r in range(self.size):
            n = int(lengths[r].item())
            out.append(json.loads(bytes(rows[r, :n].tolist())))
        return out

    def broadcast_ints(self, values: list[int] | None, n: int) -> list[int]:
        """Rank 0's ``values`` (length ``n``) on every rank, by an all-sum of zeros elsewhere."""
        mx = self.mx
        local = mx.array(values if self.rank == 0 else [0] * n, dtype=mx.int32)
        if self.size == 1:
            return local.tolist()
        out = mx.distributed.all_sum(local, group=self.group)
        mx.eval(out)
        return out.tolist()


class Stage:
    """This rank's contiguous slice of the model's layers (a pipeline stage)."""

    def __init__(self, mx, ring: Ring, model, plan, eos: set[int], prefill_chunk: int,
                 cache_templates: list):
        from mlx_lm.models.base import create_attention_mask, create_ssm_mask

        self.mx, self.ring, self.model, self.plan = mx, ring, model, plan
        self.inner = model.model
        self.layers = self.inner.layers[plan.layer_start:plan.layer_end]
        self.templates = cache_templates[plan.layer_start:plan.layer_end]
        self.linear = [bool(getattr(layer, "is_linear", False)) for layer in self.layers]
        self.eos, self.chunk = eos, prefill_chunk
        self.first, self.last = ring.rank == 0, ring.rank == ring.size - 1
        self._attn_mask, self._ssm_mask = create_attention_mask, create_ssm_mask
        self.hidden = model.args.hidden_size
        self.dtype = None
        self.limit_bytes: int | None = None
        self.fault_bytes = int(os.environ.get(FAULT_BYTES, "0"))
        self.fault_at = int(os.environ.get(FAULT_AT, "0"))

    def check_memory(self, step: int, held: list) -> None:
        """Running out is checked, not trusted to the allocator: past the limit, stop the ring."""
        mx = self.mx
        if self.fault_bytes and step == self.fault_at:
            spike = mx.zeros((self.fault_bytes // 4,), dtype=mx.float32)
            mx.eval(spike)
            held.append(spike)
        active = mx.get_active_memory()
        if self.limit_bytes is not None and active > self.limit_bytes:
            raise RanOut(f"rank {self.ring.rank} ran out of its admitted memory at decode step "
                         f"{step}: active {active} B > allocation limit {self.limit_bytes} B")

    def _masks(self, h, caches: list) -> list:
        """One mask per layer kind, built from the first cache of that kind (as mlx-lm does)."""
        attn = next((c for c, lin in zip(caches, self.linear, strict=True) if not lin), None)
        ssm = next((c for c, lin in zip(caches, self.linear, strict=True) if lin), None)
        masks = {False: self._attn_mask(h, attn) if attn is not None else None,
                 True: self._ssm_mask(h, ssm) if ssm is not None else None}
        return [masks[lin] for lin in self.linear]

    def _forward(self, tokens: list[int], caches: list, want_token: bool) -> int | None:
        mx, ring = self.mx, self.ring
        if self.first:
            h = self.inner.embed_tokens(mx.array([tokens]))
        else:
            h = mx.distributed.recv((1, len(tokens), self.hidden), self.dtype, ring.rank - 1,
                                    group=ring.group)
        masks = self._masks(h, caches)
        for layer, mask, cache in zip(self.layers, masks, caches, strict=True):
            h = layer(h, mask, cache)
        if not self.last:
            mx.eval(mx.distributed.send(h, ring.rank + 1, group=ring.group))
            token = mx.array([0], dtype=mx.int32)
        else:
            h = self.inner.norm(h[:, -1:, :])
            head = getattr(self.model, "lm_head", None)
            logits = head(h) if head is not None else self.inner.embed_tokens.as_linear(h)
            token = mx.argmax(logits[0, -1], axis=-1, keepdims=True).astype(mx.int32)
            mx.eval(token, [c.state for c in caches])
        if not want_token:
            return None
        if ring.size > 1:
            token = mx.distributed.all_sum(token, group=ring.group)
        mx.eval(token)
        return int(token.item())

    def generate(self, prompt: list[int], max_tokens: int, on_token) -> list[int]:
        caches = [copy.deepcopy(t) for t in self.templates]
        head, y = prompt[:-1], prompt[-1]
        for i in range(0, len(head), self.chunk):
            self._forward(head[i:i + self.chunk], caches, want_token=False)
        out: list[int] = []
        held: list = []
        for step in range(max_tokens):
            self.check_memory(step, held)
            y = self._forward([y], caches, want_token=True)
            out.append(y)
            on_token(y)
            if y in self.eos:
                break
        return out


def _load_stage(mx, ring, model_dir: Path, plan, prefill_chunk: int) -> Stage:
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, config = load_model(model_dir, lazy=True)
    inner = model.model
    n = len(inner.layers)
    # Empty caches of the right kind per layer (KV, or arrays for linear attention), taken
    # before foreign layers are dropped; each request deep-copies its own.
    if hasattr(model, "make_cache"):
        templates = model.make_cache()
    else:
        from mlx_lm.models.cache import KVCache

        templates = [KVCache() for _ in range(n)]
    for i in range(n):
        if not plan.layer_start <= i < plan.layer_end:
            inner.layers[i] = None
    tied = not hasattr(model, "lm_head")
    if not plan.holds_embeddings and not (plan.holds_head and tied):
        inner.embed_tokens = None
    if not plan.holds_head:
        inner.norm = None
        if not tied:
            model.lm_head = None
    params = [v for _, v in tree_flatten(model.parameters())]
    mx.eval(params)
    eos = config.get("eos_token_id", [])
    eos = set(eos if isinstance(eos, list) else [eos])
    stage = Stage(mx, ring, model, plan, eos, prefill_chunk, templates)
    stage.dtype = params[0].dtype if params else mx.float32
    stage.loaded_bytes = sum(v.nbytes for v in params)
    return stage


def _serve(ring: Ring, stage: Stage, context: int) -> int:
    """Rank 0: stdin requests → ring broadcast; every rank runs each request in lockstep."""
    while True:
        header = None
        if ring.rank == 0:
            line = sys.stdin.readline()
            req = json.loads(line) if line.strip() else {"op": "shutdown"}
            if req.get("op") == "generate":
                prompt = [int(t) for t in req["prompt"]]
                max_tokens = int(req["max_tokens"])
                if not prompt or prompt[0] < 0 or len(prompt) + max_tokens > context:
                    emit("refused", reason=f"prompt {len(prompt)} + max_tokens {max_tokens} "
                         f"exceeds the committed context {context} (or the prompt is empty)")
                    continue
                header = [OP_GENERATE, len(prompt), max_tokens]
            else:
                header = [OP_SHUTDOWN, 0, 0]
        op, n, max_tokens = ring.broadcast_ints(header, 3)
        if op == OP_SHUTDOWN:
            return EXIT_OK
        prompt = ring.broadcast_ints(prompt if ring.rank == 0 else None, n)
        start = time.monotonic()
        report = (lambda t: emit("token", id=t)) if ring.rank == 0 else (lambda t: None)
        out = stage.generate(prompt, max_tokens, report)
        if ring.rank == 0:
            elapsed = time.monotonic() - start
            emit("done", tokens=out, seconds=elapsed,
                 tokens_per_s=len(out) / elapsed if elapsed > 0 else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m plimsoll.cluster.rank")
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--host", default="")
    p.add_argument("--ceiling-bytes", type=int)
    p.add_argument("--total-ram-bytes", type=int)
    p.add_argument("--budget-bytes", type=int)
    p.add_argument("--figures-by-rank", help="JSON list, indexed by rank, of {ceiling_bytes, "
                   "total_ram_bytes, budget_bytes}: one command line for every rank, as "
                   "mlx.launch needs, with each rank's own figures")
    p.add_argument("--policy", type=Path, help="This host's policy (clustered budget).")
    p.add_argument("--request", default="{}", help="ClusterRequest as JSON (same on every rank)")
    args = p.parse_args(argv)
    _parent_watchdog()

    import mlx.core as mx

    from plimsoll.cluster import plan as cp
    from plimsoll.cluster.weights import read_config, tensor_bytes
    from plimsoll.model_facts import inspect_model

    try:
        if os.environ.get("MLX_HOSTFILE"):
            group = mx.distributed.init(backend="ring", strict=True)
        else:
            group = mx.distributed.init()
    except Exception as e:
        emit("error", rank=int(os.environ.get("MLX_RANK", 0)), phase="init",
             reason=f"cannot join the ring: {e}")
        return EXIT_INIT
    ring = Ring(mx, group)
    try:
        request = cp.ClusterRequest.model_validate_json(args.request)
        probe = _own_probe(args, ring.rank)
        probes = [cp.RankProbe.model_validate(x) for x in ring.all_gather_json(probe.model_dump())]
        config, facts = read_config(args.model), inspect_model(args.model)
        plans = cp.plan_cluster(config, facts, tensor_bytes(args.model), probes, request)
        answer = cp.preflight(plans[ring.rank], probe, facts, request)
        previous_limit = None
        if answer.admitted:  # reserve: this rank may allocate no more than it was admitted
            previous_limit = mx.set_memory_limit(answer.decision.allocation_limit_bytes)
            answer = answer.model_copy(update={"reserved": True})
        emit("preflight", rank=ring.rank, answer=answer.model_dump())
        answers = [cp.Preflight.model_validate(x)
                   for x in ring.all_gather_json(answer.model_dump())]
        decision = cp.decide(answers, ring.size)
        emit("decision", rank=ring.rank, decision=decision.model_dump())
        if decision.action == "rollback":
            if previous_limit is not None:
                mx.set_memory_limit(previous_limit)
            return EXIT_ROLLBACK
        stage = _load_stage(mx, ring, args.model, plans[ring.rank], request.prefill_chunk)
        stage.limit_bytes = answer.decision.allocation_limit_bytes
        ring.broadcast_ints([1], 1)  # barrier: every rank loaded
        emit("ready", rank=ring.rank, loaded_bytes=stage.loaded_bytes,
             planned_weights_bytes=plans[ring.rank].weights_bytes,
             active_memory_bytes=mx.get_active_memory(),
             layers=[plans[ring.rank].layer_start, plans[ring.rank].layer_end],
             concurrency=decision.concurrency, context=decision.context)
        return _serve(ring, stage, decision.context)
    except RanOut as e:
        emit("error", rank=ring.rank, phase="run", reason=f"{e}; tearing down")
        return EXIT_RAN_OUT
    except RuntimeError as e:
        if "[ring]" in str(e):
            emit("error", rank=ring.rank, phase="run",
                 reason=f"rank {ring.rank} lost a peer: {e}; tearing down")
            return EXIT_PEER
        emit("error", rank=ring.rank, phase="run", reason=f"{type(e).__name__}: {e}")
        return EXIT_OTHER
    except Exception as e:
        emit("error", rank=ring.rank, phase="run", reason=f"{type(e).__name__}: {e}")
        return EXIT_OTHER


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # do not wait on the ring's background threads
