"""Pipeline-parallel planning in pure Python (never imports torch): which layers each stage
holds, which stages each pp rank holds, and which schedule / micro-batch combinations work.

Split rule (`split_layers`)
---------------------------
Stages are contiguous runs of layers, every stage at least one layer. The cost of a stage is
the number of parameters it holds:

    cost(stage) = sum(layer_params of its layers)
                  + embed_params   if it is the first stage   (token embedding)
                  + head_params    if it is the last stage    (final norm + LM head)

Put in "layer equivalents": the embedding counts as embed_params / layer_params layers on the
first stage and the head as head_params / layer_params layers on the last one, so those stages
get that many fewer transformer layers. The split minimises the most expensive stage (the
one that bounds memory and, roughly, step time); ties are broken by the smaller sum of squared
stage costs (a more even split overall), then by giving earlier stages more layers. The search
is an exact dynamic program over contiguous splits, in integer arithmetic, so it is
deterministic. To balance compute instead of memory, pass embed_params=0 (an embedding lookup
costs no matmul) and head_params = dim * vocab (the LM head's matmul).

An explicit split (`parallelism.pp_layers`, layer counts per stage) is validated and used as is.
"""
from __future__ import annotations

from collections.abc import Sequence

from usp.errors import PlanError

SCHEDULES = ("afab", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")
SINGLE_STAGE_SCHEDULES = ("afab", "1f1b")          # one stage per pp rank
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "interleaved_zb", "zbv")  # >= 2 stages per pp rank


def _balanced_hint(n_layers: int, n_stages: int) -> list[int]:
    q, r = divmod(n_layers, n_stages)
    return [q + (1 if i < r else 0) for i in range(n_stages)]


def check_explicit(explicit: object, n_layers: int, n_stages: int) -> list[int]:
    key = "parallelism.pp_layers"
    hint = f"parallelism.pp_layers={_balanced_hint(n_layers, n_stages)} (or null for a balanced split)" \
        if 0 < n_stages <= n_layers else "parallelism.pp_layers=null"
    if not isinstance(explicit, (list, tuple)) or not all(
            isinstance(c, int) and not isinstance(c, bool) for c in explicit):
        raise PlanError("must be a list of layer counts, one per pipeline stage",
                        key=key, value=explicit, fix=hint)
    counts = list(explicit)
    if len(counts) != n_stages:
        raise PlanError(f"has {len(counts)} entries but there are {n_stages} pipeline stages "
                        f"(pp x pp_virtual_stages)", key=key, value=explicit, fix=hint)
    if any(c < 1 for c in counts):
        raise PlanError("every pipeline stage needs at least one layer", key=key, value=explicit, fix=hint)
    if sum(counts) != n_layers:
        raise PlanError(f"sums to {sum(counts)} layers but the model has {n_layers} (model.n_layers)",
                        key=key, value=explicit, fix=hint)
    return counts


def split_layers(n_layers: int, n_stages: int, embed_params: int, head_params: int,
                 layer_params: int | Sequence[int],
                 explicit: Sequence[int] | None = None) -> list[list[int]]:
    """Layer ids of each of the `n_stages` stages (n_stages = pp * virtual stages), contiguous
    and in order. `layer_params` is the parameter count of one layer (or a list, one per layer).
    `explicit`: the user's layer counts per stage, validated and used as given. See the module
    docstring for the balancing rule."""
    if n_stages < 1:
        raise PlanError("needs at least one pipeline stage", key="parallelism.pp", value=n_stages,
                        fix="parallelism.pp=1")
    if n_stages > n_layers:
        raise PlanError(f"the model has fewer layers than the {n_stages} pipeline stages "
                        f"(pp x pp_virtual_stages); every stage needs at least one layer",
                        key="model.n_layers", value=n_layers,
                        fix=f"lower parallelism.pp / parallelism.pp_virtual_stages so that "
                            f"pp x pp_virtual_stages <= {n_layers}, or use more layers")
    if explicit is not None:
        counts = check_explicit(explicit, n_layers, n_stages)
    elif isinstance(layer_params, int):
        counts = list(uniform_split(n_layers, n_stages, embed_params, head_params, layer_params))
    else:
        costs: list[int] = [layer_params] * n_layers if isinstance(layer_params, int) else list(layer_params)
        if len(costs) != n_layers:
            raise ValueError(f"layer_params has {len(costs)} entries for {n_layers} layers")
        counts = _balanced_counts(costs, n_stages, embed_params, head_params)
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def _balanced_counts(costs: list[int], n_stages: int, embed: int, head: int) -> list[int]:
    """Exact DP: best[s][i] = best (max cost, sum of squares) placing layers i.. into stages s..
    Reconstruction takes the largest first stage among equal optima (earlier stages get more)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, i: int, j: int) -> int:  # stage s holds layers i..j-1
        return prefix[j] - prefix[i] + (embed if s == 0 else 0) + (head if s == n_stages - 1 else 0)

    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    best[n_stages][n] = (0, 0)
    for s in range(n_stages - 1, -1, -1):
        rest = n_stages - 1 - s  # stages after s, each needs >= 1 layer
        for i in range(s, n - rest):
            cand = inf
            for j in range(i + 1, n - rest + 1):
                tail = best[s + 1][j]
                if tail == inf:
                    continue
                c = stage_cost(s, i, j)
                cand = min(cand, (max(c, tail[0]), c * c + tail[1]))
            best[s][i] = cand
    counts, i = [], 0
    for s in range(n_stages):
        rest = n_stages - 1 - s
        for j in range(n - rest, i, -1):  # largest stage first among ties
            tail = best[s + 1][j]
            if tail == inf:
                continue
            c = stage_cost(s, i, j)
            if (max(c, tail[0]), c * c + tail[1]) == best[s][i]:
                counts.append(j - i)
                i = j
                break
    return counts


def uniform_split(n: int, stages: int, embed: int, head: int, layer: int) -> tuple:
    """_balanced_counts for equal layers, in O(n²) instead of
    its O(stages·n²) dynamic program (the search calls it for every pp): the first and last stage
    sizes are enumerated, the middle stages share the rest evenly (extra layers first), and the
    same objective picks the winner: the smallest (max stage cost, sum of squared costs), then
    the largest earlier stages. tests/unit/test_planner.py checks it against split_layers."""
    if stages == 1:
        return (n,)
    k = stages - 2
    best_key, best = None, None
    for first in range(1, n - stages + 2):
        c_first = first * layer + embed
        for last in range(n - first - k, 0, -1):  # a smaller last stage = larger middle ones: preferred on ties
            rest = n - first - last
            if k == 0:
                if rest:
                    continue
                mid_max, mid_sq = 0, 0
            else:
                q, r = divmod(rest, k)
                mid_max = (q + (1 if r else 0)) * layer
                mid_sq = r * ((q + 1) * layer) ** 2 + (k - r) * (q * layer) ** 2
            c_last = last * layer + head
            key = (max(c_first, c_last, mid_max), c_first * c_first + c_last * c_last + mid_sq, -first, last)
            if best_key is None or key < best_key:
                best_key, best = key, (first, rest, last)
    assert best is not None  # the loop above always tries at least one split
    first, rest, last = best
    q, r = divmod(rest, k) if k else (0, 0)
    return (first, *([q + 1] * r + [q] * (k - r)), last)


def arch_split(arch, n_stages: int, pp_layers: Sequence[int] | None = None) -> list[list[int]]:
    """split_layers for a model shape (usp.perf.specs.Arch): the memory-balanced split, or the
    explicit parallelism.pp_layers. The last stage always holds a v x h LM head: with tied
    embeddings it is the embedding's copy (usp/engine/parallel/tied.py)."""
    return split_layers(arch.n_layers, n_stages, arch.embed_params, arch.dim + arch.embed_params, arch.layer_params,
                        list(pp_layers) if pp_layers else None)


def matmul_threshold_split(arch, pp: int) -> tuple[int, ...]:
    """Layers per pp rank as nanotron's build_model assigns them (models/base.py at the playbook's
    sweep): blocks in order (embedding, layers, final norm, LM head) go to the current rank until
    the cumulative matmul cost exceeds (rank + 1)/pp of the total, where a layer costs its matmul
    weights (4h² + 3hf) and the LM head V·h. The head outweighs a few layers, so the first ranks get
    more layers than the last ones, and the last may get none (pp beyond the layers it can fill).
    The planner's `nanotron` profile uses it; usp's engine uses split_layers."""
    layer = 4 * arch.dim * arch.dim + 3 * arch.dim * arch.ffn_dim
    total = arch.n_layers * layer + arch.vocab_size * arch.dim
    counts, rank = [0] * pp, 0
    for i in range(1, arch.n_layers + 1):
        counts[rank] += 1
        if rank < pp - 1 and i * layer * pp > total * (rank + 1):
            rank += 1
    return tuple(counts)


def stage_ranks(pp: int, virtual: int, schedule: str) -> list[list[int]]:
    """Stage indices held by each pp rank, in the order the rank builds them.
    Loop order (afab, 1f1b, interleaved): rank r holds r, r+pp, r+2pp, ...
    V-shape (zbv, exactly 2 per rank): rank r holds r and 2pp-1-r, so rank 0 holds both the
    first and the last stage."""
    if schedule == "zbv":
        if virtual != 2:
            raise PlanError("the zbv schedule needs exactly 2 stages per pp rank",
                            key="parallelism.pp_virtual_stages", value=virtual,
                            fix="parallelism.pp_virtual_stages=2")
        return [[r, 2 * pp - 1 - r] for r in range(pp)]
    return [[r + v * pp for v in range(virtual)] for r in range(pp)]


def last_stage_rank(pp: int, virtual: int, schedule: str) -> int:
    """The pp rank that holds the last stage (computes the loss)."""
    n_stages = pp * virtual
    return next(r for r, stages in enumerate(stage_ranks(pp, virtual, schedule)) if n_stages - 1 in stages)


def validate_schedule(schedule: str, pp: int, virtual: int, n_microbatches: int) -> None:
    """Raise PlanError if torch.distributed.pipelining (2.13) would reject or cannot run this
    combination. n_microbatches is the number of micro batches per step (train.grad_accum).
    Torch's own rules, encoded exactly:
      * 1f1b: n_microbatches >= number of stages (= pp here).
      * interleaved_1f1b / interleaved_zb: rounds = max(1, n_microbatches // pp) must divide
        n_microbatches (so any n <= 2pp-1 works; above that, a multiple of the rounds).
      * zbv: exactly 2 stages per rank; any n_microbatches >= 1.
      * afab: any n_microbatches >= 1.
    With pp == 1 the pipeline is off: only the schedule name is checked."""
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown pipeline schedule; choose one of {', '.join(SCHEDULES)}",
                        key="parallelism.pp_schedule", value=schedule, fix="parallelism.pp_schedule=1f1b")
    if pp <= 1:
        return
    vkey = "parallelism.pp_virtual_stages"
    if schedule in SINGLE_STAGE_SCHEDULES and virtual != 1:
        raise PlanError(f"the {schedule} schedule runs one stage per pp rank",
                        key=vkey, value=virtual,
                        fix=f"{vkey}=1, or parallelism.pp_schedule=interleaved_1f1b for several stages per rank")
    if schedule in MULTI_STAGE_SCHEDULES and virtual < 2:
        raise PlanError(f"the {schedule} schedule needs at least 2 stages per pp rank",
                        key=vkey, value=virtual, fix=f"{vkey}=2, or parallelism.pp_schedule=1f1b")
    if schedule == "zbv" and virtual != 2:
        raise PlanError("the zbv schedule needs exactly 2 stages per pp rank (V shape)",
                        key=vkey, value=virtual, fix=f"{vkey}=2")
    gkey = "train.grad_accum"
    if n_microbatches < 1:
        raise PlanError("the pipeline needs at least one micro batch per step", key=gkey,
                        value=n_microbatches, fix=f"{gkey}={pp}")
    if schedule == "1f1b" and n_microbatches < pp:
        raise PlanError(f"the 1f1b schedule needs at least as many micro batches as pipeline "
                        f"stages ({pp})", key=gkey, value=n_microbatches,
                        fix=f"{gkey}={pp} (or more), or parallelism.pp_schedule=afab")
    if schedule in ("interleaved_1f1b", "interleaved_zb"):
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            lower, upper = n_microbatches - n_microbatches % pp, n_microbatches + pp - n_microbatches % pp
            raise PlanError(f"the {schedule} schedule runs micro batches in rounds of "
                            f"max(1, n // pp) = {rounds}, which must divide the micro-batch count",
                            key=gkey, value=n_microbatches,
                            fix=f"{gkey}={lower} or {upper} (a multiple of pp={pp})")

