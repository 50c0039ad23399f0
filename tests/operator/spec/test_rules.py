"""The spec's rules without a cluster: the hostile-spec catalog (operator rows), the examples, and the
runtime's memory plan and known configurations run before any pod exists."""

from __future__ import annotations

import pytest
from spyre_operator.admission import check_spec
from spyre_operator.settings import OperatorSettings
from spyre_operator.spec.model_spec import InvalidSpec
from spyre_operator.spec.parse import parse_spec
from spyre_operator.spec.runtime_contract import check_runtime_contract

from tests.conftest import REPO
from tests.operator.catalog import BASE, CATALOG


@pytest.mark.parametrize("row", [r for r in CATALOG if r.by == "operator"], ids=lambda r: r.id)
def test_catalog_refused_by_the_operator_with_a_message_naming_the_problem(row):
    """Every row the operator refuses on its own (on clusters that ignore CEL), schema rows included: a
    spec written before a CRD upgrade may predate its schema."""
    with pytest.raises(InvalidSpec) as err:
        check_spec(row.name, row.spec, OperatorSettings())
    assert row.needle in str(err.value)


def test_catalog_has_enough_rows_and_valid_base():
    assert len(CATALOG) >= 40 and len({r.id for r in CATALOG}) == len(CATALOG)
    check_runtime_contract(check_spec("m", BASE, OperatorSettings()))
    # a current cluster refuses most rows at create time; the operator, every row the 1.20 server accepts
    assert sum(bool(r.at_create) for r in CATALOG) >= 35
    assert all(r.at_create for r in CATALOG if r.schema)


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_example_is_a_valid_spec(path):
    import yaml

    models = [d for d in yaml.safe_load_all(path.read_text()) if d["kind"] == "SpyreModel"]
    for doc in models:
        check_runtime_contract(check_spec(doc["metadata"]["name"], doc["spec"], OperatorSettings()))
    # an autoscaler's example drives a SpyreModel of the examples
    assert models or path.stem in ("hpa", "keda-scaledobject")


def test_memory_plan_and_known_configurations_before_any_pod():
    from spyre_operator.settings import OperatorSettings
    from spyre_operator.spec.parse import UnknownConfiguration
    from spyre_operator.spec.runtime_contract import check_fit

    from tests.operator.catalog import LLAMA_70B

    big = {"source": "pvc://models/big", "config": LLAMA_70B}
    settings = OperatorSettings()
    with pytest.raises(InvalidSpec, match="largest consumer is the weights"):
        check_fit(parse_spec("m", {**BASE, "backend": "sendnn", "model": big}), settings)
    check_fit(
        parse_spec("m", {**BASE, "backend": "sendnn", "cards": 8, "model": big}), settings
    )  # 8 cards fit
    on_cpu = {**BASE, "model": big, "resources": {"limits": {"memory": "64Gi"}}}
    with pytest.raises(InvalidSpec, match="container memory"):
        check_fit(parse_spec("m", on_cpu), settings)
    known = {"source": "pvc://models/x", "architecture": "LlamaForCausalLM"}
    with pytest.raises(UnknownConfiguration) as err:
        check_fit(
            parse_spec("m", {**BASE, "cards": 8, "model": known}), OperatorSettings(require_known_config=True)
        )
    assert err.value.reason == "UnknownConfiguration" and "nearest" in str(err.value)
    with pytest.raises(InvalidSpec, match=r"model\.architecture"):
        check_fit(parse_spec("m", {**BASE, "requireKnownConfiguration": True}), settings)


# a 1.3B float32 decoder whose continuous-batching KV cache is its largest consumer: 24 GiB in float32
KV_BOUND = {
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "intermediate_size": 5632,
    "vocab_size": 32000,
    "torch_dtype": "float32",
}


def test_the_memory_plan_counts_the_kv_cache_in_its_own_dtype():
    """A float32 model whose KV cache does not fit the container's memory fits with a bfloat16 cache (half
    the bytes per token); kvCacheDtype float32 is the model's own, so it is refused as auto is."""
    from spyre_operator.spec.runtime_contract import check_fit

    spec = {
        **BASE,
        "model": {"source": "pvc://models/m", "config": KV_BOUND},
        "batching": {"mode": "continuous", "maxNumSeqs": 16, "maxModelLen": 4096},
        "resources": {"limits": {"memory": "32Gi"}},
    }
    for kv_cache_dtype in ("auto", "float32"):
        with pytest.raises(InvalidSpec, match=r"largest consumer is the KV cache \(24\.02 GiB\)"):
            check_fit(parse_spec("m", {**spec, "kvCacheDtype": kv_cache_dtype}), OperatorSettings())
    check_fit(parse_spec("m", {**spec, "kvCacheDtype": "bfloat16"}), OperatorSettings())
