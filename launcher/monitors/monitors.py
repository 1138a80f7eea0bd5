"""The monitors of one run, written to TensorBoard. ``Monitors.after_step(step)`` runs what is due after an optimizer
step:

- every ``monitor.spectral_interval`` steps: spectral norms of every layer's W_Q, W_K, W_V, W_O, fc_in, fc_out and
  of each head's block of W_Q and W_K (power iteration with persistent vectors, see spectral.py);
- every ``monitor.probe_interval`` steps, on the fixed probe batch: RMS and top singular value of each layer's
  attention input X and attention output O; tie rates (whole row; inside one tile of the run's numerics), maximum
  logit and entropy per layer and head (attention_stats.py); the delta bias of ``monitor.delta_bias_layers`` (delta_bias.py).

With ``monitor.qk_update`` the spectral call also measures the spectra of each head's query-key product update since
the previous spectral call, and with ``monitor.qk_activation`` the probe call the spectral entropy of pre-softmax
scores of a few probe tokens, on ``monitor.qk_layers`` (qk_update.py). Each rank computes them from the rows of the
heads it owns (no gather of W_Q or W_K) and the per-head values are gathered like the other per-head statistics.

Both also run at step 1. Tag names come from tags.py. An interval of 0 disables that part; ``delta_bias_layers: []``
disables the delta-bias monitor alone. Per-head tags are logged for ``monitor.head_layers`` only (by default the
delta-bias layers and the warning layer), layer-wide tags for every layer, so the scalars per monitor step stay
bounded at any depth (docs/monitoring.md, "At scale").

Everything works one layer at a time, so the working set is one layer's share, whatever the model's size. Under
tensor parallelism the tags and values are those of the single-device model: spectral norms of the full matrices,
computed from the ranks' slices without gathering them (a power iteration whose products are all-reduced,
spectral.py); under ZeRO-3 one matrix at a time is gathered over data parallel. Each rank computes the per-head
statistics (per-head spectral norms, tie rate, max logit, entropy, delta bias) of the heads it owns, and the per-head
values are gathered in global head order. The ranks that compute are those of the logging rank's tensor-parallel
group (all ranks under ZeRO-3, whose parameters only exist gathered over data parallel); only the logging rank
writes.

Under pipeline parallelism every stage computes the monitors of its own layers (the probe batch flows through the
pipeline, forward and back, see probe.py) and sends its values to the logging rank, which writes the same global tag
names as one process.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from kernels.modes import tie_tile_keys
from launcher.config import warning_inputs_on
from launcher.fp8 import side_pass
from launcher.monitors import tags
from launcher.parallel.dims import ParallelDims
from launcher.parallel.sequence import local_seq_len
from launcher.parallel.tensor import Shard, gather_full, head_range, shard_of
from launcher.sharded import Sharded
from launcher.monitors.attention_stats import head_stats, kernel_inputs, layer_stats, scores
from launcher.monitors.delta_bias import cosine_from_parts, layer_delta_bias
from launcher.monitors.capture import Capture, capture_model, capture_stage
from launcher.monitors.qk_update import QKUpdateTracker, activation_entropy, layer_aggregates, token_positions
from launcher.monitors.spectral import SpectralTracker
from launcher.monitors.warning import EarlyWarning, Onset, WarningRule
from model.attention import noise_keys

STATE_VERSION = 3  # 3: checkpoint entries, per-head state in per-head chunks; 2: one dict gathered on rank 0
RUN_ENTRY = "monitors/run"


def spectral_entry(stage_key: str) -> str:
    return f"monitors/spectral/{stage_key}"


def head_entry(kind: str, layer: int) -> str:
    """The checkpoint entry of a per-head state tensor of a layer (kind delta_cum, prev_error, qk_previous_q or
    qk_previous_k), all heads."""
    return f"monitors/{kind}/{layer}"


def entries_from_format2(state: dict) -> dict:
    """A format-2 checkpoint's monitor state (one dict, all heads and stages) as checkpoint entries
    (launcher/checkpoint.py converts such checkpoints)."""
    entries = {spectral_entry(key): vectors for key, vectors in state["spectral_vectors"].items()}
    for kind in ("delta_cum", "prev_error"):
        for i, t in state[kind].items():
            entries[head_entry(kind, int(i))] = Sharded(tuple(t.shape), [((0,) * t.dim(), t)])
    entries[RUN_ENTRY] = {"version": STATE_VERSION, "overhead_s": state["overhead_s"],
                          "last_values": state["last_values"], "warning": state.get("warning")}
    return entries


def _due(step: int, interval: int) -> bool:
    return interval > 0 and (step == 1 or step % interval == 0)


class _Values:
    """Collects 0-d or per-head tensors under tag names and moves them to the host in one transfer."""

    def __init__(self):
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []

    def add(self, tag: str, value: torch.Tensor) -> None:
        self.names.append(tag)
        self.tensors.append(value.detach().reshape(1).double())

    def add_heads(self, tag_of_head: Callable[[int], str], values: torch.Tensor) -> None:
        for h in range(values.numel()):
            self.names.append(tag_of_head(h))
        self.tensors.append(values.detach().reshape(-1).double())

    def to_dict(self) -> dict[str, float]:
        if not self.tensors:
            return {}
        flat = torch.cat([t.to(self.tensors[0].device) for t in self.tensors]).tolist()
        return dict(zip(self.names, flat))


class Monitors:
    """Spectral-norm, activation, attention and delta-bias monitors of one run (see module docstring)."""

    def __init__(self, config, model: torch.nn.Module, probe_batch: tuple[torch.Tensor, torch.Tensor], writer,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 backend: str = "reference", dims: Optional[ParallelDims] = None, engine=None):
        """``model``: the model, or under pipeline parallelism this rank's stage; ``engine`` (optional; needed under
        ZeRO-3 and a pipeline): the trainer's engine, which knows this rank's blocks (and a stage's layers)."""
        mon, att = config.monitor, config.attention
        self.model = model
        self.probe_batch = probe_batch
        self.writer = writer
        self.autocast = autocast
        self.backend = backend
        self.dims = dims or ParallelDims(device=probe_batch[0].device)
        self.engine = engine
        zero3 = engine is not None and engine.zero_stage == 3
        # ranks that take part: the logging rank's tensor-parallel group, or every rank under ZeRO-3
        self.active = self.dims.dp_rank == 0 or zero3
        # this rank's blocks by global layer index (a pipeline stage holds some of them)
        self.layers: dict[int, torch.nn.Module] = engine.blocks() if engine is not None else dict(enumerate(model.blocks))
        self.layer_ids = sorted(self.layers)
        first = self.layers[self.layer_ids[0]]
        # the run's attention settings (kernels.modes.AttentionSettings), read from the model: what its attention
        # computes and how it is launched, this rank's global head index included; None for backend=sdpa
        self.settings = getattr(first.attn.attention_fn, "settings", None)
        if self.settings is None and backend != "sdpa":
            raise ValueError(f"the model's attention has no kernel settings but the monitors' backend is {backend}: "
                             "bind it with model.build_attention")
        numerics = att if self.settings is None else self.settings  # sdpa: the config's (fa2, validated)
        self.rounding, self.eps = numerics.rounding, numerics.eps
        # the tile in which a repeated maximum matters for the run's numerics
        self.tie_tile = tie_tile_keys(numerics.rounding, numerics.paper_block_keys)
        self.n_layer = config.model.n_layer
        self.d_model = config.model.d_model
        self.sequence_parallel = config.parallel.sequence_parallel
        self.n_head = config.model.n_head  # of the whole model; this rank's are head_offset .. + local_heads - 1
        self.head_offset, _ = head_range(self.n_head, self.dims)
        self.local_heads = first.attn.n_head
        self.head_dim = first.attn.head_dim
        self.spectral_interval = mon.spectral_interval
        self.probe_interval = mon.probe_interval
        wanted = mon.delta_layers(self.n_layer)
        self.any_delta = bool(wanted)  # under a pipeline, every stage takes part in the backward then
        self.delta_layers = [i for i in wanted if i in self.layers]
        self.head_layers = set(mon.per_head_layers(self.n_layer))  # the others log layer-wide tags only
        self.tracker = SpectralTracker(mon.power_iterations, tol=mon.power_tolerance)
        qk_layers = range(self.n_layer) if mon.qk_layers is None else sorted(set(mon.qk_layers))
        self.qk_layers = [i for i in qk_layers if i in self.layers]
        self.qk_update = QKUpdateTracker() if mon.qk_update and self.qk_layers else None
        self.qk_positions = token_positions(*probe_batch[0].shape, mon.qk_tokens) if mon.qk_activation else None
        self.delta_cum: dict[int, torch.Tensor] = {}
        self.prev_error: dict[int, torch.Tensor] = {}
        self._last: dict[str, float] = {}
        self._overhead_s = 0.0
        self._delta_cost_printed = False
        # early warning (warning.py), evaluated where the merged values of all stages are: the logging rank
        rule = WarningRule.from_monitor(mon)
        self.warning = EarlyWarning(rule) if rule.enabled and rule.layer < self.n_layer else None
        measured = warning_inputs_on(config)
        if self.warning is not None and not any(measured[s] for s in rule.thresholds()) \
                and self.dims.is_logging_rank:
            # the default rule rests where its monitor is off (launcher/config.py): say so, once, at the start
            print(f"[monitors] early warning off in this run: {', '.join(rule.thresholds())} reads monitors that "
                  "are off here (monitor.probe_interval, qk_activation, qk_layers; docs/monitoring.md)", flush=True)
        self._warned = False
        self._onset: Optional[Onset] = None

    # ------------------------------------------------------------------------------------------------------------
    # Trainer-facing API

    @property
    def overhead_s(self) -> float:
        """Total seconds spent in the monitors so far (including time restored from a checkpoint)."""
        return self._overhead_s

    def last_values(self) -> dict[str, float]:
        """Latest value of every tag logged so far (printed by the guards when a step goes bad)."""
        return dict(self._last)

    def ran_at(self, step: int) -> bool:
        """Whether some monitor part is due at ``step`` (the same answer on every rank)."""
        return _due(step, self.spectral_interval) or _due(step, self.probe_interval)

    def after_step(self, step: int) -> dict[str, float]:
        """Run whatever is due at optimizer step ``step`` (1-based), log it with global_step=step, return it.
        Every rank calls it; ranks outside the computing group (see the module docstring) return {} at once."""
        if not self.active:
            return {}
        do_spectral = _due(step, self.spectral_interval)
        do_probe = _due(step, self.probe_interval)
        if not (do_spectral or do_probe):
            return {}
        device = self.probe_batch[0].device
        start = self._clock(device)
        values: dict[str, float] = {}
        # The monitors' own arithmetic is FP32/FP64 whatever context the caller is in; the probe forward enters the
        # run's autocast itself.
        with torch.autocast(device.type, enabled=False):
            if do_spectral:
                values.update(self._spectral())
                values[tags.SPECTRAL_SECONDS] = self._clock(device) - start
                if self.qk_update is not None:
                    qk_start = self._clock(device)
                    values.update(self._qk_update())
                    values[tags.QK_UPDATE_SECONDS] = self._clock(device) - qk_start
            if do_probe:
                probe_start = self._clock(device)
                values.update(self._probe(device))
                values[tags.PROBE_SECONDS] = self._clock(device) - probe_start
        self._overhead_s += self._clock(device) - start
        values = self._from_all_stages(values)
        if self.warning is not None and self.dims.is_logging_rank:
            values.update(self._warn(step, values))
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, global_step=step)
        self._last.update(values)
        return values

    def state_dict(self) -> dict:
        """This rank's part of the persistent state, as checkpoint entries (launcher/checkpoint.py; local, nothing is
        gathered): the running delta-bias sums and last dW_Q error matrices of this rank's layers as its heads'
        chunks of all-head tensors; the power-iteration vectors of this rank's layers and tensor-parallel part,
        under the layers and part they cover (another layout starts them afresh); the rest from the logging rank."""
        if not self.active:
            return {}
        entries = {}
        for kind, tensors in (("delta_cum", self.delta_cum), ("prev_error", self.prev_error)):
            for i, t in tensors.items():
                entries[head_entry(kind, i)] = self._heads_chunk(t)
        # the last spectral call's W_Q and W_K head blocks: the next call's update starts from them
        for i, pair in (self.qk_update.previous if self.qk_update else {}).items():
            for kind, blocks in zip(("qk_previous_q", "qk_previous_k"), pair):
                entries[head_entry(kind, i)] = self._heads_chunk(blocks)
        if self.dims.dp_rank == 0:
            entries[spectral_entry(self._stage_key())] = self.tracker.state_dict()
        if self.dims.is_logging_rank:
            entries[RUN_ENTRY] = {"version": STATE_VERSION, "overhead_s": self._overhead_s,
                                  "last_values": dict(self._last),
                                  "warning": self.warning.state_dict() if self.warning is not None else None}
        return entries

    def _heads_chunk(self, t: torch.Tensor) -> Sharded:
        """This rank's heads (dimension 0) of a per-head state tensor, as a chunk of the all-head tensor."""
        return Sharded((self.n_head, *t.shape[1:]), [((self.head_offset,) + (0,) * (t.dim() - 1), t)])

    def checkpoint_destinations(self, saved: set[str]) -> dict:
        """The entries of a checkpoint holding ``saved`` that :meth:`load_state_dict` takes: this rank's heads of its
        delta-bias layers, its stage's vectors, the run-level state."""
        if not self.active:
            return {}
        device = self.probe_batch[0].device
        local = {"delta_cum": ((self.local_heads,), torch.float64),
                 "prev_error": ((self.local_heads, self.head_dim, self.d_model), torch.float32)}
        wanted = {}
        for i in self.delta_layers:
            for kind, (shape, dtype) in local.items():
                if head_entry(kind, i) in saved:
                    wanted[head_entry(kind, i)] = self._heads_chunk(torch.zeros(shape, dtype=dtype, device=device))
        if self.qk_update is not None:  # this rank's heads of its watched layers' (H, hd, d) W_Q and W_K blocks
            for i in self.qk_layers:
                for kind in ("qk_previous_q", "qk_previous_k"):
                    if i in self.layers and head_entry(kind, i) in saved:
                        blocks = torch.zeros((self.local_heads, self.head_dim, self.d_model), device=device)
                        wanted[head_entry(kind, i)] = self._heads_chunk(blocks)
        for key in (spectral_entry(self._stage_key()), RUN_ENTRY):
            if key in saved:
                wanted[key] = None
        return wanted

    def _stage_key(self) -> str:
        """The layers this rank's vectors cover and its part of them (split weights keep split vectors)."""
        return ",".join(map(str, self.layer_ids)) + f"/tp{self.dims.tp_rank}of{self.dims.tp}"

    def _gather_stages(self, obj) -> Optional[list]:
        """``obj`` of every pipeline stage, in stage order, on the logging rank (None on the others and without a
        pipeline). The stages' first tensor-parallel ranks send; the others already hold the same values."""
        if self.dims.pp == 1 or self.dims.tp_rank != 0:
            return None
        group = self.dims.pp_group
        out = [None] * self.dims.pp if self.dims.pp_rank == 0 else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(group, 0), group=group)
        return out

    def _from_all_stages(self, values: dict[str, float]) -> dict[str, float]:
        """The values of every stage on the logging rank; timings are the slowest stage's."""
        stages = self._gather_stages(values)
        if stages is None:
            return values
        merged: dict[str, float] = {}
        for stage_values in stages:
            for tag, value in stage_values.items():
                merged[tag] = max(merged.get(tag, value), value) if tag.startswith("monitor/") else value
        return merged

    def load_state_dict(self, read: dict) -> None:
        """Install what was read for :meth:`checkpoint_destinations`."""
        if not self.active:
            return
        run = read.get(RUN_ENTRY)
        if run is not None and run.get("version") != STATE_VERSION:
            raise ValueError(f"monitor state version {run.get('version')} is not {STATE_VERSION}; "
                             "resume with the code that wrote the checkpoint")
        device = self.probe_batch[0].device
        self.tracker.load_state_dict(read.get(spectral_entry(self._stage_key())) or {}, device)
        for kind, tensors in (("delta_cum", self.delta_cum), ("prev_error", self.prev_error)):
            tensors.clear()
            for i in self.delta_layers:
                if head_entry(kind, i) in read:
                    tensors[i] = read[head_entry(kind, i)].chunks[0][1]
        if self.qk_update is not None:  # absent in checkpoints written before the qk-update monitor
            pairs = {i: tuple(read.get(head_entry(kind, i)) for kind in ("qk_previous_q", "qk_previous_k"))
                     for i in self.qk_layers}
            self.qk_update.previous = {i: (q.chunks[0][1], k.chunks[0][1]) for i, (q, k) in pairs.items()
                                       if q is not None and k is not None}
        if run is None:
            return
        self._overhead_s = float(run["overhead_s"])
        self._last = dict(run["last_values"])
        if self.warning is not None and run.get("warning"):  # absent in checkpoints written before the warning
            self.warning.load_state_dict(run["warning"])
            self._warned = self.warning.on

    def attention_rebound(self) -> None:
        """The model's attention was rebuilt mid-run (monitor.on_warning=switch_fix): read its settings again, so
        that the delta-bias monitor reconstructs the backward's delta with the new numerics from now on."""
        first = self.layers[self.layer_ids[0]]
        self.settings = getattr(first.attn.attention_fn, "settings", None)
        if self.settings is not None:
            self.rounding, self.eps = self.settings.rounding, self.settings.eps
            self.tie_tile = tie_tile_keys(self.settings.rounding, self.settings.paper_block_keys)

    def onset_at(self, step: int) -> Optional[Onset]:
        """The early warning's onset if it turned on at ``step`` (logging rank; None elsewhere and otherwise)."""
        return self._onset if self._onset is not None and self._onset.step == step else None

    def _warn(self, step: int, values: dict[str, float]) -> dict[str, float]:
        out = self.warning.update(step, values)
        if out.get(tags.WARNING) and not self._warned:  # say it once per onset, on the console too
            self._onset = self.warning.onset
            print(f"[monitors] EARLY WARNING at step {step}: {self._onset.describe()} (rule: "
                  f"{self.warning.rule.describe()}; launcher/monitors/warning.py, thresholds monitor.warning_*)",
                  flush=True)
        self._warned = bool(out.get(tags.WARNING, self._warned))
        return out

    # ------------------------------------------------------------------------------------------------------------

    @staticmethod
    def _clock(device: torch.device) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def _all_heads(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's per-head tensor (heads first) extended to all heads of the model, in global order."""
        return gather_full(t, Shard(0, self.dims.tp), self.dims)

    def _weight(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Context giving this rank's FP32 slice of a linear layer's weight (ZeRO-3: gathered over data parallel for
        the duration, this one matrix only)."""

        @contextlib.contextmanager
        def slice_of():
            weight = module.weight
            with self.engine.gathered([weight]) if self.engine is not None else contextlib.nullcontext():
                yield weight.detach().float()

        return slice_of()

    def _split(self, module: torch.nn.Module) -> tuple[Optional[int], Optional[object]]:
        """(which dimension of a (1, m, n) batch this rank holds part of, the group holding the rest) of a weight."""
        shard = shard_of(module.weight)
        if shard is None or self.dims.tp == 1:
            return None, None
        return shard.dim + 1, self.dims.tp_group

    @torch.no_grad()
    def _spectral(self) -> dict[str, float]:
        """One matrix at a time, never gathered over tensor parallelism (launcher/monitors/spectral.py): the working
        set is one weight's slice (and a d x d Gram matrix at a fresh start)."""
        values = _Values()
        heads: dict = {}
        for i in self.layer_ids:
            block = self.layers[i]
            for name, path in tags.WEIGHTS.items():
                module = functools.reduce(getattr, path.split("."), block)  # (through checkpoint wrappers, FP8 views)
                split, group = self._split(module)
                with self._weight(module) as weight:
                    values.add(tags.spectral(i, name), self.tracker(f"L{i}/{name}", weight[None], split, group)[0])
                    if name in tags.PER_HEAD_WEIGHTS and i in self.head_layers:
                        # this rank's heads: row blocks of its (column-parallel) slice, no communication
                        blocks = weight.view(self.local_heads, self.head_dim, -1)
                        heads[(i, name)] = self.tracker(f"L{i}/{name}/heads", blocks)
        for (i, name), per_head in self._gather_heads(heads).items():
            values.add_heads(lambda h, i=i, name=name: tags.spectral(i, name, h), per_head)
        return values.to_dict()

    def _local_weight(self, module: torch.nn.Module) -> torch.Tensor:
        """This rank's FP32 rows of a linear layer's weight (its heads under tensor parallelism; gathered over data
        parallel under ZeRO-3), as a copy."""
        weight = module.weight
        context = self.engine.gathered([weight]) if self.engine is not None else contextlib.nullcontext()
        with context:
            return weight.detach().float().clone()

    @torch.no_grad()
    def _qk_update(self) -> dict[str, float]:
        """Spectra of each watched layer's Q-K product update since the previous spectral call (qk_update.py); the
        first call only stores the weights."""
        local = {}
        for i in self.qk_layers:
            attn = self.layers[i].attn
            heads = (self.local_heads, self.head_dim, -1)
            stats = self.qk_update(i, self._local_weight(attn.q_proj).view(heads),
                                   self._local_weight(attn.k_proj).view(heads))
            if stats is not None:
                local.update({(i, stat): v for stat, v in stats.items()})
        per_head = self._gather_heads(local)
        values = _Values()
        for i in self.qk_layers:
            if (i, tags.QK_UPDATE_STATS[0]) not in per_head:
                continue
            layer = {stat: per_head[(i, stat)] for stat in tags.QK_UPDATE_STATS}
            for stat, value in layer_aggregates(layer).items():
                values.add(tags.qk_update(i, stat), value)
            if i in self.head_layers:
                for stat, value in layer.items():
                    values.add_heads(lambda h, i=i, stat=stat: tags.qk_update(i, stat, h), value)
        return values.to_dict()

    def _gather_heads(self, local: dict) -> dict:
        """{key: this rank's per-head (local_heads,) tensor} -> {key: all heads (n_head,) in FP64}, in one collective
        (FP64 with one process too, so that layer aggregates are computed alike under every layout)."""
        if not local:
            return local
        keys = list(local)
        stacked = torch.stack([local[k].double() for k in keys], dim=1)  # (local_heads, K)
        full = self._all_heads(stacked)
        return {k: full[:, j] for j, k in enumerate(keys)}

    def _probe(self, device: torch.device) -> dict[str, float]:
        delta_layers = self.delta_layers
        # only some ranks run the probe: FP8 FFNs run it in BF16 (no amax collective, no scaling state touched)
        with side_pass(self.model):
            probe = self._probe_pass(delta_layers)
        values = _Values()
        with torch.no_grad():
            local = {}
            for i in self.layer_ids:  # one layer at a time
                cap = probe.layers[i]
                x = cap.x.float().flatten(0, -2)  # (B*T, d), the same on every tensor-parallel rank
                # this rank's heads of O as columns of the single-device model's out_proj input (B*T, H*hd): split
                # over the group like a row-parallel weight's columns, its norms formed without gathering it
                o = cap.o.float().transpose(1, 2).flatten(2).flatten(0, 1)
                split = (2, self.dims.tp_group) if self.dims.tp > 1 else (None, None)
                o_sq = o.square().sum()
                if self.dims.tp > 1:
                    dist.all_reduce(o_sq, group=self.dims.tp_group)
                rows = x.shape[0] ** 0.5  # top singular values are divided by sqrt(rows) to compare with the RMS
                values.add(tags.act(i, "x_rms"), x.pow(2).mean().sqrt())
                values.add(tags.act(i, "x_sv"), self.tracker(f"L{i}/act_x", x[None])[0] / rows)
                values.add(tags.act(i, "o_rms"), (o_sq / (o.numel() * self.dims.tp)).sqrt())
                values.add(tags.act(i, "o_sv"), self.tracker(f"L{i}/act_o", o[None], *split)[0] / rows)
                s = scores(kernel_inputs(cap.q, self.backend), kernel_inputs(cap.k, self.backend), self.rounding)
                local.update({(i, stat): v for stat, v in head_stats(s, self.eps, self.tie_tile).items()})
                del s
                if self.qk_positions is not None and i in self.qk_layers:
                    local[(i, "qk_act")] = activation_entropy(cap.q, cap.k, self.qk_positions)
            per_head = self._gather_heads(local)
            for i in self.layer_ids:
                layer = {stat: per_head[(i, stat)] for stat in tags.ATTN_STATS}
                for stat, value in layer_stats(layer).items():
                    values.add(tags.attn(i, stat), value)
                if i in self.head_layers:
                    for stat, value in layer.items():
                        values.add_heads(lambda h, i=i, stat=stat: tags.attn(i, stat, h), value)
                if (i, "qk_act") in per_head:
                    entropy = per_head[(i, "qk_act")]
                    values.add(tags.qk_act(i, "entropy"), entropy.nanmean())
                    if i in self.head_layers:
                        values.add_heads(lambda h, i=i: tags.qk_act(i, "entropy", h), entropy)
        result = values.to_dict()
        if delta_layers:
            start = self._clock(device)
            result.update(self._delta_bias(probe))
            cost = self._clock(device) - start
            result[tags.DELTA_BIAS_SECONDS] = cost
            if not self._delta_cost_printed and self.writer is not None:
                self._delta_cost_printed = True
                b, t = self.probe_batch[0].shape
                print(f"[monitors] delta bias: {len(delta_layers)} layer(s) x probe batch {b}x{t}, "
                      f"{cost:.3f} s per call, every {self.probe_interval} steps", flush=True)
        return result

    def _probe_pass(self, grad_layers: list[int]) -> Capture:
        """The probe batch through this rank's layers: the whole model, or under a pipeline this rank's stage, with
        activations and gradients passed between the stages (every stage takes part; probe.py)."""
        dims = self.dims
        if dims.pp == 1:
            return capture_model(self.model, self.probe_batch, self.autocast, grad_layers, self.layers)
        # what crosses a stage boundary: (batch, positions of this rank, d_model); sequence parallelism keeps T / tp
        batch_size, seq_len = self.probe_batch[0].shape
        hidden = (batch_size, local_seq_len(seq_len, dims, self.sequence_parallel), self.d_model)
        return capture_stage(self.model, self.engine.stage_functions(), self.engine.model_loss, self.layers,
                             self.probe_batch, self.autocast, grad_layers, self.any_delta, dims.pp_rank, dims.pp,
                             dims.pp_group, hidden, dims.device)

    @torch.no_grad()
    def _delta_bias(self, probe) -> dict[str, float]:
        local = {}
        for i in self.delta_layers:
            cap = probe.layers[i]
            # the probe pass ran without row keys: its attention used those of row key 0 (model.attention.noise_keys)
            keyed = self.settings is not None and self.settings.needs_noise_keys
            keys = noise_keys(None, i, cap.q.shape[0], cap.q.device) if keyed else None
            out = layer_delta_bias(cap.q, cap.k, cap.v, cap.o, cap.d_out, cap.x, self.backend, self.settings,
                                   self.prev_error.get(i), keys)
            cum = self.delta_cum.get(i)
            self.delta_cum[i] = out["sum"].clone() if cum is None else cum.to(out["sum"]) + out["sum"]
            self.prev_error[i] = out["error"].float()  # (heads, head_dim, d_model), rows of q_proj.weight per head
            local[(i, "sum")], local[(i, "cum")] = out["sum"], self.delta_cum[i]
            for part in ("dot", "error_sq", "previous_sq"):
                if part in out:
                    local[(i, part)] = out[part]
        per_head = self._gather_heads(local)
        values = _Values()
        for i in self.delta_layers:
            heads = i in self.head_layers
            for stat in ("sum", "cum"):
                values.add(tags.delta_bias(i, stat), per_head[(i, stat)].sum())
                if heads:
                    values.add_heads(lambda h, i=i, stat=stat: tags.delta_bias(i, stat, h), per_head[(i, stat)])
            if (i, "dot") in per_head:
                dot, err_sq, prev_sq = (per_head[(i, p)] for p in ("dot", "error_sq", "previous_sq"))
                values.add(tags.delta_bias(i, "dwq_cos"), cosine_from_parts(dot.sum(), err_sq.sum(), prev_sq.sum()))
                if heads:
                    values.add_heads(lambda h, i=i: tags.delta_bias(i, "dwq_cos", h),
                                     cosine_from_parts(dot, err_sq, prev_sq))
        return values.to_dict()
