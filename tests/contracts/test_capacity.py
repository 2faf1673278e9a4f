"""The capacity model against the two real models, with figures checked by hand, and the
agent's own refusal of a load it cannot hold."""

import json
import struct
from pathlib import Path

import pytest

from agent.capacity import load_fit_check
from contracts import capacity
from contracts.commands import CommandRefused, parse_load_payload
from contracts.streams import ContractError
from tests.agent.test_agent_processes import MODEL_FILE
from tests.agent.test_folder_versions import MINILM

CONFIG = {
    "dtype": "bfloat16",
    "max_model_len": 512,
    "kv_block_size": 16,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 512,
}
# SmolLM2-135M: 30 layers, 3 KV heads of 64 dims; embedding 49152 x 576 (tied), and per
# layer q, o 576x576, k, v 576x192, gate, up, down 576x1536, two norms of 576.
SMOLLM2_PARAMETERS = (
    49152 * 576 + 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576) + 576
)
# all-MiniLM-L6-v2: BERT, 6 layers of 384 (1536 inside), vocabulary 30522, 512 positions.
MINILM_LAYER = 4 * (384 * 384 + 384) + 768 + (384 * 1536 + 1536) + (1536 * 384 + 384) + 768
MINILM_PARAMETERS = 30522 * 384 + 512 * 384 + 2 * 384 + 768 + 6 * MINILM_LAYER + 384 * 384 + 384


@pytest.fixture(scope="module")
def smollm2() -> capacity.ModelShape:
    return capacity.gguf_shape(MODEL_FILE)


def test_the_gguf_header_gives_smollm2s_parameters_and_attention_geometry(smollm2) -> None:
    assert SMOLLM2_PARAMETERS == 134_515_008
    assert smollm2 == capacity.ModelShape(
        parameters=134_515_008,
        tensor_bytes=96_576_768,  # Q4_1 and Q8_0 blocks as stored
        layers=30,
        kv_heads=3,
        head_dim=64,
        has_kv_cache=True,
    )


def test_a_bfloat16_version_with_a_fixed_pool(smollm2) -> None:
    footprint = capacity.footprint_compute(
        smollm2, serving_config=CONFIG, engine="builtin", engine_args={"num_blocks": 128}
    )
    per_token = 2 * 30 * 3 * 64 * 2  # K and V, every layer, bf16
    assert footprint.kv_bytes_per_token == per_token == 23_040
    assert footprint.kv_tokens == 128 * 16
    assert footprint.weight_bytes == 134_515_008 * 2 == 269_030_016
    assert footprint.kv_bytes == 2048 * 23_040 == 47_185_920
    # 10% of 316,215,936, rounded up
    assert footprint.headroom_bytes == 31_621_594
    assert footprint.total_bytes == 269_030_016 + 47_185_920 + 31_621_594 == 347_837_530
    assert footprint.kv_basis == "engine_args.num_blocks"
    assert footprint.describe() == "0.32 GiB (weights 0.25 GiB, KV 0.04 GiB, headroom 0.03 GiB)"


def test_the_built_in_engines_default_pool_is_what_it_allocates(smollm2) -> None:
    footprint = capacity.footprint_compute(
        smollm2, serving_config={**CONFIG, "dtype": "float32"}, engine="builtin", engine_args={}
    )
    # 1 GiB in whole blocks of 16 tokens x 46,080 bytes: 1456 blocks
    assert footprint.kv_bytes_per_token == 46_080
    assert footprint.kv_tokens == (2**30 // (46_080 * 16)) * 16 == 23_296
    assert footprint.kv_bytes == 1_073_479_680
    assert footprint.weight_bytes == 134_515_008 * 4
    assert footprint.kv_basis == "the built-in engine's default KV pool"


def test_other_engines_need_every_sequence_at_full_length_and_llama_cpp_keeps_quantized_weights(
    smollm2,
) -> None:
    vllm = capacity.footprint_compute(smollm2, serving_config=CONFIG, engine="vllm", engine_args={})
    assert (vllm.kv_tokens, vllm.kv_bytes) == (512 * 4, 512 * 4 * 23_040)
    assert vllm.kv_basis == "max_model_len x max_num_seqs"
    llama = capacity.footprint_compute(
        smollm2, serving_config=CONFIG, engine="llama.cpp", engine_args={}
    )
    assert llama.weight_bytes == 96_576_768
    assert (llama.kv_tokens, llama.kv_bytes) == (512, 512 * 23_040)


def test_the_minilm_folder_an_encoder_without_kv_cache() -> None:
    config = json.loads((MINILM / "config.json").read_text())
    shape = capacity.folder_shape(config, sorted(MINILM.glob("*.safetensors")))
    # its int64 position_ids buffer is not a parameter
    assert shape.parameters == MINILM_PARAMETERS == 22_713_216
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (6, 12, 32)
    assert shape.has_kv_cache is False
    footprint = capacity.footprint_compute(
        shape, serving_config={**CONFIG, "dtype": "float32"}, engine="builtin", engine_args={}
    )
    assert footprint.weight_bytes == 22_713_216 * 4 == 90_852_864
    assert (footprint.kv_bytes, footprint.kv_tokens) == (0, 0)
    assert footprint.headroom_bytes == 9_085_287
    assert footprint.total_bytes == 99_938_151


def test_headers_that_do_not_say_are_refused_with_the_reason(tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(MODEL_FILE.read_bytes()[:4096])
    with pytest.raises(capacity.CapacityError, match="GGUF"):
        capacity.gguf_shape(truncated)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(capacity.CapacityError, match="too large"):
        capacity.safetensors_header(huge)
    not_json = tmp_path / "bad.safetensors"
    not_json.write_bytes(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(capacity.CapacityError, match="not JSON"):
        capacity.safetensors_header(not_json)
    good = tmp_path / "model.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}})
    good.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(24))
    with pytest.raises(capacity.CapacityError, match="num_hidden_layers"):
        capacity.folder_shape({"model_type": "llama"}, [good])


def load_payload(footprint_bytes: object) -> dict[str, object]:
    return {
        "version_id": 7,
        "model": "smol",
        "label": "bf16",
        "digest": "a" * 64,
        "format": "gguf",
        "size_bytes": 1,
        "serving_config": CONFIG,
        "signature": "",
        "key_id": "k",
        "public_key": "",
        "served_model_name": "smol",
        "serving_secret": "1" * 64,
        "admin_secret": "2" * 64,
        "footprint_bytes": footprint_bytes,
    }


def test_an_agent_refuses_a_load_larger_than_it_offers_with_the_figures() -> None:
    load = parse_load_payload(load_payload(347_837_530))
    load_fit_check(load, {"memory_offered_bytes": 347_837_530})  # exactly fits
    with pytest.raises(CommandRefused) as refused:
        load_fit_check(load, {"memory_offered_bytes": 2**28})
    assert refused.value.reason == "insufficient_memory"
    assert str(refused.value) == (
        "version 7 needs 0.32 GiB (347837530 bytes); this agent offers 0.25 GiB (268435456 bytes)"
    )
    # A load without a footprint (headers that did not say) is not checked.
    load_fit_check(parse_load_payload(load_payload(0)), {"memory_offered_bytes": 0})
    for bad in (-1, "1", True, 1.5):
        with pytest.raises(ContractError, match="footprint_bytes"):
            parse_load_payload(load_payload(bad))
