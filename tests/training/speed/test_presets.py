"""The `speed` group (conf/speed/*.yaml): measured presets of the step's speed switches, refined by single
switches given after them, set by the GPU recipes; the experimental switches named at the start of a run."""
import pytest

from tests.helpers.cli import compose_cfg
from transformer.config import TrainerConfig
from transformer.experimental import in_use

SWITCHES = ("compile", "bf16_residual", "cuda_graphs", "loss")


def switches(cfg) -> dict:
    return {k: cfg.trainer[k] for k in SWITCHES}


def test_the_default_preset_is_eager_and_changes_no_default():
    schema = TrainerConfig()
    assert switches(compose_cfg()) == {k: getattr(schema, k) for k in SWITCHES}
    assert switches(compose_cfg("speed=eager")) == switches(compose_cfg())


@pytest.mark.parametrize("preset, expected", [
    ("graphs", {"compile": False, "bf16_residual": False, "cuda_graphs": True, "loss": "auto"}),
    ("compiled", {"compile": True, "bf16_residual": True, "cuda_graphs": False, "loss": "auto"}),
    ("compiled_graphs", {"compile": True, "bf16_residual": True, "cuda_graphs": True, "loss": "compiled"}),
])
def test_each_preset_sets_its_switches(preset, expected):
    assert switches(compose_cfg(f"speed={preset}")) == expected


def test_a_switch_after_the_preset_refines_it():
    cfg = compose_cfg("speed=compiled_graphs", "trainer.cuda_graphs=false", "trainer.shape_steps=8")
    assert switches(cfg) == {"compile": True, "bf16_residual": True, "cuda_graphs": False, "loss": "compiled"}
    assert cfg.trainer.shape_steps == 8


@pytest.mark.parametrize("recipe", ["wmt14_base", "wmt14_big"])
def test_the_gpu_recipes_take_the_fastest_measured_preset_and_no_experimental_switch(recipe):
    cfg = compose_cfg(f"experiment={recipe}")
    assert switches(cfg) == switches(compose_cfg("speed=compiled_graphs"))
    assert in_use(cfg.trainer) == []
    # a CPU run of the recipe says how to leave the GPU preset
    assert switches(compose_cfg(f"experiment={recipe}", "speed=eager")) == switches(compose_cfg())


@pytest.mark.parametrize("recipe", ["copy", "multi30k"])
def test_the_cpu_recipes_stay_eager(recipe):
    assert switches(compose_cfg(f"experiment={recipe}")) == switches(compose_cfg())


def test_the_experimental_switches_are_named():
    assert in_use(compose_cfg().trainer) == []
    cfg = compose_cfg("trainer.precision=fp8", "trainer.micro_batch=fit", "trainer.compile=true",
                      "trainer.compile_scope=layers", "trainer.unpadded_attention=true")
    assert in_use(cfg.trainer) == ["trainer.precision=fp8", "trainer.micro_batch=fit",
                                   "trainer.compile_scope=layers", "trainer.unpadded_attention=true"]
    # layer-wise compile is experimental only where something is compiled
    assert in_use(compose_cfg("trainer.compile_scope=layers").trainer) == []


def test_the_cuda_graph_presets_are_refused_on_a_cpu_in_one_line_naming_the_way_out():
    import torch

    from transformer.config import ConfigError
    from transformer.training.speed.graphs import check_cuda_graphs

    with pytest.raises(ConfigError, match="speed=eager"):
        check_cuda_graphs(compose_cfg("speed=graphs").trainer, torch.device("cpu"))
