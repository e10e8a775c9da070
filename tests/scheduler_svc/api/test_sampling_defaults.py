"""--generation-config: which of generation_config.json's values become the model's sampling
defaults (those apart from transformers' own, as vLLM's to_diff_dict), and what is refused."""

import json

import pytest

from pagedserve.scheduler.api.sampling_defaults import (
    GenerationConfigError,
    SamplingDefaults,
    sampling_defaults,
)


def folder(tmp_path, **config):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_models_values_apart_from_transformers_defaults(tmp_path):
    """Llama 3.1 Instruct's file, with a top_k of transformers' default and a max_new_tokens."""
    d = folder(tmp_path, bos_token_id=128000, do_sample=True, eos_token_id=[128001, 128009],
               temperature=0.6, top_p=0.9, top_k=50, max_new_tokens=64)
    assert sampling_defaults("auto", d) == SamplingDefaults(temperature=0.6, top_p=0.9,
                                                            max_tokens=64)
    assert sampling_defaults("vllm", d) == SamplingDefaults()
    (tmp_path / "other").mkdir()
    other = folder(tmp_path / "other", temperature=0.7, top_k=20, repetition_penalty=1.05)
    assert sampling_defaults(str(other), d) == SamplingDefaults(
        temperature=0.7, top_k=20, repetition_penalty=1.05)


def test_no_file_is_no_defaults_unless_a_folder_was_named(tmp_path):
    assert sampling_defaults("auto", tmp_path) == SamplingDefaults()
    with pytest.raises(GenerationConfigError, match="no generation_config.json in /nonexist"):
        sampling_defaults("/nonexistent", tmp_path)


@pytest.mark.parametrize("config, match", [
    ({"temperature": "hot"}, "temperature is 'hot'"),
    ({"top_k": 2.5}, "top_k is 2.5"),
    ({"max_new_tokens": True}, "max_new_tokens is True"),
])
def test_values_of_the_wrong_kind_are_named(tmp_path, config, match):
    with pytest.raises(GenerationConfigError, match=match):
        sampling_defaults("auto", folder(tmp_path, **config))
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(GenerationConfigError, match="cannot be read"):
        sampling_defaults("auto", tmp_path)
