"""vLLM's --pooler-config and --runner: parsing, errors naming the field, and the default
read from a sentence-transformers model directory."""

from __future__ import annotations

import json

import pytest

from engine_worker.config import EngineArgs
from engine_worker.pooler_config import PoolerConfig, model_pooler_config


def test_parse_forms():
    assert PoolerConfig.parse('{"pooling_type": "mean", "normalize": false}') == \
        PoolerConfig("MEAN", False)
    assert PoolerConfig.parse({"pooling_type": "LAST"}) == PoolerConfig("LAST", None)
    assert PoolerConfig.parse(None) == PoolerConfig() == PoolerConfig.parse("")
    config = EngineArgs(pooler_config='{"pooling_type": "CLS"}', runner="pooling") \
        .create_engine_config().model
    assert config.pooler_config == PoolerConfig("CLS", None) and config.runner == "pooling"


@pytest.mark.parametrize("value, field", [
    ('{"pooling_type": "MAX"}', "pooler_config.pooling_type"),
    ('{"normalize": "yes"}', "pooler_config.normalize"),
    ('{"dimensions": 3}', "pooler_config.dimensions"),
    ("{not json", "pooler_config"),
    ("[1]", "pooler_config"),
])
def test_bad_pooler_config_names_the_field(value, field):
    with pytest.raises(ValueError) as err:
        EngineArgs(pooler_config=value).create_engine_config()
    assert str(err.value).startswith(f"{field}:")


def test_bad_runner_names_the_field():
    with pytest.raises(ValueError, match="^runner:"):
        EngineArgs(runner="embed").create_engine_config()


def test_default_from_a_sentence_transformers_directory(tmp_path):
    assert PoolerConfig().resolved(tmp_path) == PoolerConfig("LAST", True)  # vLLM's default
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))
    assert model_pooler_config(tmp_path) == PoolerConfig("MEAN", False)
    assert PoolerConfig().resolved(tmp_path) == PoolerConfig("MEAN", False)
    assert PoolerConfig(normalize=True).resolved(tmp_path) == PoolerConfig("MEAN", True)
    assert PoolerConfig("LAST").resolved(tmp_path) == PoolerConfig("LAST", False)
