"""The family registry (moepack.families, issue 39): every family is a package with a family.json, looked up without
importing torch; DeepSeek-V4 is one of them (families/deepseek_v4/family.py), and what runs a container asks the
family, never which one it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from containers import tiny_keep_container
from moepack.families import (FAMILY_NAMES, adapter_for, check_container, container_family, family_for, family_named,
                              family_of_gguf)
from moepack.families.base import RegisteredFamily
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Container

V4_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "deepseek-v4-flash.config.json")


@pytest.fixture(scope="module")
def v4_container(tmp_path_factory) -> str:
    return tiny_keep_container(tmp_path_factory)


def test_every_family_is_registered_by_its_family_json_and_implements_the_protocol():
    assert set(FAMILY_NAMES) == {"deepseek-v4", "qwen3-moe"}
    for name in FAMILY_NAMES:
        family = family_named(name)
        assert isinstance(family, RegisteredFamily)
        package = os.path.dirname(sys.modules[type(family).__module__].__file__)
        with open(os.path.join(package, "family.json")) as f:
            entry = json.load(f)
        assert (family.name, list(family.architectures), list(family.model_types),
                list(family.gguf_architectures)) == (entry["name"], entry["architectures"], entry["model_types"],
                                                     entry["gguf_architectures"])
        assert family_for({"architectures": entry["architectures"]}) is family
        assert family_for({"model_type": entry["model_types"][0]}) is family
        assert family_of_gguf(entry["gguf_architectures"][0]) is family


def test_looking_a_deepseek_v4_config_up_imports_no_torch():
    code = ("import sys, json; from moepack.families import family_for, adapter_for; "
            f"c = json.load(open({V4_CONFIG!r})); f = family_for(c); adapter_for(c); f.parse_config(c); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(f.name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "deepseek-v4"


def test_a_model_type_its_architectures_family_does_not_take_is_refused():
    with open(V4_CONFIG) as f:
        config = json.load(f)
    assert adapter_for(config).architecture == "deepseek_v4"
    with pytest.raises(MoepackError, match=r"unsupported architecture: model_type 'llama' \(supported: deepseek_v4, "
                                           r"qwen3_moe\)"):
        adapter_for({**config, "model_type": "llama"})
    with pytest.raises(MoepackError, match=r"config.json: model_type must be a string, not \[1\]"):
        adapter_for({**config, "model_type": [1]})


def test_deepseek_v4_family_shape_and_schema_are_its_prefills_and_its_schemas(v4_container):
    from moepack.families.deepseek_v4.model import DeepseekV4Prefill
    from moepack.families.deepseek_v4.tensors import v4_tensor_specs

    with Container(v4_container) as c:
        family, cfg = check_container(c)
        assert family is family_named("deepseek-v4") and container_family(c) is family
        assert family.shape(cfg) == DeepseekV4Prefill(cfg).shape
        specs = family.tensor_specs(c.config)
        assert [(s.name, s.shape) for s in specs] == [(s.name, tuple(s.shape))
                                                      for s in v4_tensor_specs(c.config, mtp=False)]
        experts = [s for s in specs if s.role == "expert"]
        assert len(experts) == 3 * cfg.num_layers * cfg.n_routed_experts
        assert {s.name for s in experts if (s.layer, s.expert) == (1, 2)} == set(
            family.expert_naming.names(1, 2).values())
        assert family.refusal(c.config) is None and family.chat_encoding.THINK_END == "</think>"
        assert family.layer_prefill(cfg, None).shape == family.shape(cfg)


def test_check_container_names_the_container_for_an_unknown_architecture(v4_container, tmp_path):
    from containers import mutate_index

    other = str(tmp_path / "llama.moepack")
    mutate_index(v4_container, other, lambda index: index.update(architecture="llama"))
    with Container(other) as c, pytest.raises(MoepackError, match=r"holds a 'llama' model; this runtime computes "
                                                                     r"deepseek-v4 \(deepseek_v4\), qwen3-moe"):
        check_container(c)
