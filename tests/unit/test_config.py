"""Recipes load, overrides apply, and bad configs fail up front with messages that say what to change."""

import pytest
import torch

from launcher.config import ConfigError, arm_names, build_config, describe, load_config, load_recipe, parse_overrides


@pytest.mark.parametrize("recipe", ["smoke", "demo", "gpt2_small_paper", "gpt_1p3b_fp8"])
def test_shipped_recipes_are_valid(recipe):
    for arm in arm_names(load_recipe(recipe)):
        config = load_config(recipe, arm=arm)
        assert config.run.arm == arm


def test_paper_recipe_matches_the_paper_setup():
    c = load_config("gpt2_small_paper")
    assert (c.model.n_layer, c.model.n_head, c.model.d_model, c.model.max_seq_len) == (12, 12, 768, 1024)
    assert (c.optim.lr, c.optim.min_lr, c.optim.warmup_steps, c.optim.weight_decay) == (1e-3, 1e-5, 2000, 0.0)
    assert (c.optim.beta1, c.optim.beta2, c.optim.grad_clip) == (0.9, 0.95, 1.0)
    assert not c.model.bias and c.precision.dtype == "bf16"
    assert c.data.global_batch_size * c.data.seq_len == 327_680


def test_arms_differ_only_in_attention():
    tree = load_recipe("smoke")
    base, fixed = build_config(tree, "baseline"), build_config(tree, "fixed")
    assert (base.attention.rounding, base.attention.fix) == ("paper", "none")
    assert (fixed.attention.rounding, fixed.attention.fix) == ("paper", "fp32_output")
    a, b = base.to_dict(), fixed.to_dict()
    assert {k for k in a if a[k] != b[k]} == {"attention", "run"}
    assert {k for k in a["run"] if a["run"][k] != b["run"][k]} == {"arm"}


def test_overrides_are_typed():
    c = load_config("smoke", ["optim.lr=1e-3", "model.n_layer=3", "model.bias=true", "monitor.delta_bias_layers=[0,1]"])
    assert c.optim.lr == 1e-3 and isinstance(c.optim.lr, float)
    assert c.model.n_layer == 3 and c.model.bias is True and c.monitor.delta_bias_layers == [0, 1]


def test_arm_override_from_cli():
    c = load_config("smoke", ["arms.fixed.attention.beta=4"], arm="fixed")
    assert c.attention.beta == 4.0


@pytest.mark.parametrize("overrides, message", [
    (["model.n_layers=3"], "Did you mean 'n_layer'"),
    (["modle.n_layer=3"], "Did you mean 'model'"),
    (["model.n_head=3"], "must divide model.d_model"),
    (["data.seq_len=4096"], "longer than model.max_seq_len"),
    (["data.global_batch_size=12", "data.micro_batch_size=8"], "not a multiple of"),
    (["attention.backend=sdpa", "arms.baseline.attention.rounding=paper"], "needs attention.backend"),
    (["arms.baseline.attention.fix=dynamic_max", "attention.beta=1"], "must be > 1"),
    (["arms.baseline.attention.fix=nope"], "attention.fix='nope' is not one of"),
    (["attention.paper_block_keys=100"], "attention.paper_block_keys=100 must be 0 (the whole row"),
    (["arms.baseline.attention.paper_block_keys=32"], "attention.paper_block_keys=32 must be 0 (the whole row in one "
                                                      "tile, as in the paper's analysis) or a power of two >= 64"),
    (["optim.lr=fast"], "optim.lr must be a number"),
    (["model.n_layer=2.5"], "model.n_layer must be an integer"),
    (["parallel.pipeline_parallel=2", "parallel.zero_stage=2"], "supports ZeRO stage 0 or 1 only"),
    (["parallel.pipeline_parallel=5"], "use at most one stage per block"),
    (["parallel.zero_stage=4"], "must be 0 (DDP), 1, 2 or 3"),
    (["parallel.tensor_parallel=2", "model.n_head=1"], "model.n_head=1 is not divisible by parallel.tensor_parallel=2"),
    (["parallel.tensor_parallel=2", "model.vocab_size=1001"], "set model.vocab_size=1002"),
    (["monitor.delta_bias_layers=[7]"], "layers are 0..3"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel=true splits the sequence over the "
     "tensor-parallel group and needs parallel.tensor_parallel > 1 (it is 1); set parallel.tensor_parallel=2"),
    (["parallel.tensor_parallel=2", "parallel.sequence_parallel=true", "data.seq_len=127"],
     "data.seq_len=127 is not divisible by parallel.tensor_parallel=2, which parallel.sequence_parallel=true needs "
     "(each rank keeps seq_len / tensor_parallel positions); set data.seq_len=126"),
    (["parallel.zero_reduce_bucket_size=0"],
     "zero_allgather_bucket_size and zero_prefetch_bucket_size must be positive"),
    (["attention.delta_gain=-1"], "attention.delta_gain=-1.0 must be a finite number >= 0"),
    (["attention.delta_gain=.inf"], "attention.delta_gain must be a finite number, got inf"),
    (["attention.delta_gain=nan"], "attention.delta_gain must be a finite number, got nan"),
    (["optim.lr=nan"], "optim.lr must be a finite number, got nan"),
    (["optim.lr=-.inf"], "optim.lr must be a finite number, got -inf"),
    (["arms.baseline.attention.beta=nan"], "arms.baseline.attention.beta must be a finite number, got nan"),
    (["monitor.warning_tie_rate=.nan"], "monitor.warning_tie_rate must be a finite number, got nan"),
    (["attention.delta_sign=flipped"], "attention.delta_sign='flipped' is not one of: kept, random"),
    (["arms.baseline.attention.delta_sign=sometimes"], "attention.delta_sign='sometimes' is not one of"),
    (["attention.backend=sdpa", "arms.baseline.attention.rounding=fa2", "attention.delta_gain=20"],
     "rounding=fa2, fix=none, delta_gain=20, delta_sign=kept needs attention.backend=triton, reference or auto"),
    (["attention.backend=sdpa", "arms.baseline.attention.rounding=fa2", "attention.delta_sign=random"],
     "delta_sign=random needs attention.backend"),
    (["attention.backend=sdpa", "arms.baseline.attention.rounding=fa2", "arms.baseline.attention.fix=stochastic_output"],
     "fix=stochastic_output needs attention.backend"),
    (["attention.backend=triton", "precision.dtype=fp32", "arms.baseline.attention.fix=stochastic_output"],
     "the Triton and Gluon kernels take BF16 inputs; set precision.dtype=bf16"),
    (["lr=3"], "needs a section and a field"),
    (["optim.lr"], "not of the form"),
])
def test_bad_configs_say_what_to_change(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_config("smoke", overrides)


def test_every_problem_is_found_in_one_pass():
    """Type errors, unknown keys, value checks and an arm's own mistakes of one command, all in one message; a check
    that would read a value that could not be read is left out (it would mislead)."""
    with pytest.raises(ConfigError) as err:
        load_config("smoke", ["optim.lr=fast", "optim.min_lr=0.5", "model.n_layerz=3", "run.max_steps=0",
                              "data.seq_len=4096", "arms.fixed.attention.fix=nope", "model.dropout=.inf"], arm="fixed")
    text = str(err.value)
    assert text.startswith("invalid configuration (6 problems):"), text
    for said in ("optim.lr must be a number, got 'fast'", "Did you mean 'n_layer'", "run.max_steps=0 must be positive",
                 "data.seq_len=4096 is longer", "arms.fixed.attention.fix='nope' is not one of",
                 "model.dropout must be a finite number, got inf"):
        assert said in text, said
    assert "optim.min_lr" not in text  # compared with a learning rate that could not be read
    with pytest.raises(ConfigError, match="2 problems"):
        parse_overrides(["lr=3", "optim.lr"])


def test_paper_block_keys_reaches_the_attention():
    """Default 512 (the kernels' default, the authors' tile); 0 (whole row) and powers of two >= 64 are accepted and
    bound into the attention callable the model uses."""
    from kernels.modes import PAPER_BLOCK_KEYS
    from model.attention import build_attention

    assert load_config("smoke").attention.paper_block_keys == PAPER_BLOCK_KEYS == 512
    for tile in (0, 64, 1024):
        config = load_config("smoke", [f"attention.paper_block_keys={tile}"])
        assert build_attention(config.attention, torch.device("cpu")).settings.paper_block_keys == tile


def test_arms_may_set_the_delta_stress_and_stochastic_output():
    """delta_gain, delta_sign and fix=stochastic_output are attention fields: arms may differ in them (the margin
    tool's grid), and only arms that draw random bits need row keys."""
    overrides = ["arms.fixed.attention.delta_gain=20", "arms.fixed.attention.delta_sign=random",
                 "arms.baseline.attention.fix=stochastic_output", "precision.dtype=bf16"]
    fixed, base = (load_config("smoke", overrides, arm=arm).attention for arm in ("fixed", "baseline"))
    assert (fixed.delta_gain, fixed.delta_sign, fixed.fix) == (20.0, "random", "fp32_output") and fixed.needs_noise_keys
    assert (base.delta_gain, base.delta_sign, base.fix) == (1.0, "kept", "stochastic_output") and base.needs_noise_keys
    assert not load_config("smoke", ["attention.delta_gain=0"]).attention.needs_noise_keys
    assert "attention.delta_gain = 1.0" in describe() and "attention.delta_sign = 'kept'" in describe()


def test_world_size_divides_batch():
    with pytest.raises(ConfigError, match=r"data-parallel size 3 .* for example set data.global_batch_size=12"):
        load_config("smoke", world_size=3)
    with pytest.raises(ConfigError, match="for example set data.micro_batch_size=2"):
        load_config("smoke", ["data.micro_batch_size=3"], world_size=4)
    assert load_config("smoke", world_size=2).data.micro_batch_size == 4  # the README's torchrun line


def test_layouts_that_cannot_work_say_what_to_change():
    with pytest.raises(ConfigError, match="3 process.* cannot be split into tensor_parallel=2 .* products that do: 1, 3"):
        load_config("smoke", ["parallel.tensor_parallel=2"], world_size=3)
    with pytest.raises(ConfigError, match="cannot be split evenly over 2 data-parallel ranks; for example set "
                                          "eval.batches=4"):
        load_config("smoke", ["eval.batches=3", "data.micro_batch_size=1"], world_size=2)
    assert load_config("smoke", ["parallel.tensor_parallel=2", "parallel.zero_stage=3"], world_size=4)


def test_arms_may_not_change_other_sections():
    tree = load_recipe("smoke", ["arms.fixed.optim.lr=1"])
    with pytest.raises(ConfigError, match="may differ only in 'attention'"):
        build_config(tree, "fixed")


def test_unknown_arm_and_recipe():
    with pytest.raises(ConfigError, match="its arms are: baseline, fixed"):
        load_config("smoke", arm="treatment")
    with pytest.raises(ConfigError, match="one of: .*smoke"):
        load_recipe("no_such_recipe")


def test_every_field_is_documented():
    text = describe()
    undocumented = [a for a, b in zip(text.splitlines(), text.splitlines()[1:]) if a.startswith("  ") and " = " in a
                    and not b.strip()]
    assert not undocumented, f"fields without a docstring: {undocumented}"


def test_parse_overrides_nests():
    assert parse_overrides(["a.b.c=1", "a.d=x"]) == {"a": {"b": {"c": 1}, "d": "x"}}


def test_fp8_layouts_are_validated_up_front():
    """FP8 FFNs run in every layout; what cannot work is refused with what to change."""
    fp8 = ["precision.fp8_ffn=true"]
    for layout in (["parallel.tensor_parallel=2"], ["parallel.pipeline_parallel=2"], ["parallel.zero_stage=3"],
                   ["parallel.activation_checkpointing=true", "precision.fp8_recipe=block"]):
        load_config("smoke", fp8 + layout, world_size=2)
    with pytest.raises(ConfigError, match="fp8_recipe=delayed with parallel.activation_checkpointing=true.*"
                                          "use precision.fp8_recipe=current or block"):
        load_config("smoke", fp8 + ["parallel.activation_checkpointing=true"])
    with pytest.raises(ConfigError, match="divisible by 16.*change model.d_model"):
        load_config("smoke", fp8 + ["model.d_model=72", "model.n_head=1"])
    with pytest.raises(ConfigError, match="precision.fp8_recipe='mx' is not one of: delayed, current, block"):
        load_config("smoke", fp8 + ["precision.fp8_recipe=mx"])


def test_overlap_settings_reach_deepspeed_with_its_own_defaults():
    """The typed overlap fields become DeepSpeed's zero_optimization section; by default they are DeepSpeed's own
    values (overlap_comm left to DeepSpeed, which turns it on for stage 3 only), so the defaults change nothing."""
    from launcher.parallel.dims import ParallelDims
    from launcher.parallel.engine import deepspeed_config

    dims = ParallelDims()
    section = deepspeed_config(load_config("smoke", ["parallel.zero_stage=2"]), dims, 2)["zero_optimization"]
    assert section == {"stage": 2, "contiguous_gradients": True, "reduce_bucket_size": 500_000_000,
                       "allgather_bucket_size": 500_000_000}
    config = load_config("smoke", ["parallel.zero_stage=3", "parallel.zero_overlap_comm=false",
                                   "parallel.zero_reduce_bucket_size=20000000",
                                   "parallel.zero_prefetch_bucket_size=1000"])
    section = deepspeed_config(config, dims, 3)["zero_optimization"]
    assert section["overlap_comm"] is False and section["reduce_bucket_size"] == 20_000_000
    assert section["stage3_prefetch_bucket_size"] == 1000


def test_fused_fp8_parameters_keep_the_plain_model_names():
    from launcher.parallel.names import canonical_name

    assert canonical_name("blocks.3.mlp.fused.fc1_weight") == "blocks.3.mlp.fc_in.weight"
    assert canonical_name("blocks.3.mlp.fused.fc2_bias") == "blocks.3.mlp.fc_out.bias"
    assert canonical_name("blocks.10.mlp.fused.layer_norm_weight") == "blocks.10.ln2.weight"
    assert canonical_name("blocks.3.attn.q_proj.weight") == "blocks.3.attn.q_proj.weight"
    # activation checkpointing wraps the block around the fused FFN
    assert canonical_name("blocks.3._checkpoint_wrapped_module.mlp.fused.fc1_bias") == "blocks.3.mlp.fc_in.bias"


def test_stochastic_output_on_a_gpu_needs_bf16(monkeypatch, tmp_path):
    """On a GPU, backend auto is the Triton kernel, which takes BF16 inputs only: fp32 precision is refused up front."""
    from launcher.config import environment_problems

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = load_config("smoke", ["arms.baseline.attention.fix=stochastic_output", "precision.dtype=fp32",
                                   f"run.out_dir={tmp_path}"])
    assert any("stochastic_output on a GPU" in p and "precision.dtype=bf16" in p for p in environment_problems(config))
    config.precision.dtype = "bf16"
    assert not any("stochastic_output" in p for p in environment_problems(config))


def test_parameter_estimate_takes_the_prepared_vocabulary(kjv_data):
    """The CPU warning and the margin tool's memory estimate count the data's vocabulary (meta.json), not GPT-2's
    50,304, when model.vocab_size=0; within 3% of the model built with it."""
    import json

    from launcher.config import parameter_estimate, resolve_vocab_size
    from model import GPT

    config = load_config("smoke", [f"data.data_dir={kjv_data}", "model.n_layer=6", "model.d_model=384",
                                   "model.n_head=6", "model.max_seq_len=256", "data.seq_len=256"])
    params, vocab = parameter_estimate(config)
    assert vocab == json.loads((kjv_data / "meta.json").read_text())["vocab_size"] != 50304
    built = GPT(resolve_vocab_size(config, vocab).model).num_parameters()
    assert abs(params / built - 1) < 0.03, (params, built)
    assert parameter_estimate(load_config("smoke", ["data.data_dir=/nonexistent"]))[1] == 50304
